"""The remote tier: parked blocks and conversation manifests in a store other engines share (Redis, Valkey).

`store.py` is the one interface a backend implements (`RemoteStore`); `redis_store.py` is the Redis/Valkey
backend; `values.py` turns blocks and manifests into the bytes stored (the disk tier's file format, checksums
and identity included) and back; `tier.py` is what the cache talks to (lookups, write-through, health).
"""
