"""Measure the conversation cache on this machine: block size trade-off, RAM and disk park/restore rates.

    python -m engine.cache.bench [--tokens 4096] [--blocks 64,128,256] [--dir /path/on/the/disk/to/test]

Disk parks return once the K/V is captured in host memory (disk_park_MBps); disk_written_MBps runs until the
background writer has published the files (fsync included), and disk restores read those files.
The K/V layout is SmolLM2-135M's on CPU (30 layers, 3 KV heads, head dim 64, float32: 45 KiB per token).
Raw references, measured the same way in the same run: memory copy (torch copy_), sequential write with
fsync, and hot read (page cache). Each figure is the best of `--repeat` runs, which filters out other load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from engine.cache.facade import ConversationCache
from engine.cache.identity import CacheIdentity
from engine.cache.parts import kv_reader, kv_writer
from engine.cache.settings import CacheSettings
from engine.kv import KVBuffers, KVLayout

SMOLLM2 = KVLayout(n_layers=30, n_kv_heads=3, head_dim=64, dtype=torch.float32)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def raw_rates(nbytes: int, folder: str, file_bytes: int, repeat: int) -> dict[str, float]:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    memcpy = nbytes / best(lambda: dst.copy_(src), repeat)
    data = memoryview(src.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
    n_files = max(nbytes // file_bytes, 1)

    def write() -> None:
        fds = []
        for i in range(n_files):
            fd = os.open(os.path.join(folder, f"raw-{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(fd, data[i * file_bytes : (i + 1) * file_bytes])
            fds.append(fd)
        for fd in fds:
            os.fsync(fd)
            os.close(fd)

    def read() -> None:
        buf = bytearray(file_bytes)
        for i in range(n_files):
            with open(os.path.join(folder, f"raw-{i}"), "rb", buffering=0) as f:
                f.readinto(buf)

    write_rate = n_files * file_bytes / best(write, repeat)
    read_rate = n_files * file_bytes / best(read, repeat)
    for i in range(n_files):
        os.unlink(os.path.join(folder, f"raw-{i}"))
    return {"memcpy": memcpy, "write_fsync": write_rate, "read_hot": read_rate}


def measure_block(block: int, n_tokens: int, folder: str, repeat: int) -> dict[str, float]:
    layout = SMOLLM2
    ident = CacheIdentity({"architecture": "llama", "bench": True}, layout, block)
    kv = KVBuffers(layout, 2, n_tokens + block, [("cpu", 0, layout.n_layers)])
    for stage in kv.stages:
        stage.k.normal_()
        stage.v.normal_()
    nbytes = n_tokens * layout.bytes_per_token
    out: dict[str, float] = {}
    for storage in ("ram", "disk"):
        sub = tempfile.mkdtemp(dir=folder)
        s = CacheSettings(
            storage=storage,
            ram_bytes=4 * nbytes,
            disk_bytes=4 * nbytes,
            dir=sub,
            min_free_bytes=0,
            block_tokens=block,
        )
        cache = ConversationCache(s, ident, engine_version="bench")
        parks, written, restores = [], [], []
        for r in range(repeat):
            tokens = [(r * 7919 + i * 31) % 49152 for i in range(n_tokens)]
            t0 = time.perf_counter()
            result = cache.park(tokens, kv_reader(lambda a, b: kv.read(0, a, b)))
            parks.append(time.perf_counter() - t0)
            assert result.parked, result
            # disk: until the background writer has published it, so the restore reads its files
            assert cache.flush(600)
            written.append(time.perf_counter() - t0)
            hit = cache.lookup(tokens + [1])
            assert hit is not None, "the conversation just parked is found"
            t0 = time.perf_counter()
            cache.restore(hit, kv_writer(lambda start, data: kv.write(1, start, data)))
            restores.append(time.perf_counter() - t0)
        out[f"{storage}_park_MBps"] = nbytes / min(parks) / 1e6  # until park() returns
        out[f"{storage}_written_MBps"] = nbytes / min(written) / 1e6  # disk: until its files are published
        out[f"{storage}_restore_MBps"] = nbytes / min(restores) / 1e6
        # one more turn of 40 tokens: what the re-park captures
        grown = tokens + list(range(40))  # noqa: RUF005
        kv.write(0, 0, kv.read(0, 0, n_tokens))  # unchanged prefix
        result = cache.park(grown, kv_reader(lambda a, b: kv.read(0, a, b)))
        out[f"{storage}_repark_KiB"] = result.new_bytes / 1024
        t0 = time.perf_counter()
        for _ in range(100):
            cache.lookup(grown + [5])
        out["lookup_ms"] = (time.perf_counter() - t0) * 10
        cache.close(spill=False)
        shutil.rmtree(sub, ignore_errors=True)
    out["block_MiB"] = ident.block_bytes / (1 << 20)
    out["unshared_tokens_avg"] = block / 2  # a divergence point falls mid-block on average
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4200)  # a partial last block at every block size
    parser.add_argument("--blocks", default="64,128,256")
    parser.add_argument("--dir", default="")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.dir and not os.path.isdir(args.dir):
        parser.error(f"--dir: expected an existing folder to measure the disk in, got {args.dir!r}")
    folder = tempfile.mkdtemp(prefix="strata-bench-", dir=args.dir or None)
    try:
        nbytes = args.tokens * SMOLLM2.bytes_per_token
        print(f"{args.tokens} tokens = {nbytes / 2**20:.0f} MiB of K/V (SmolLM2-135M layout, float32)")
        raw = raw_rates(nbytes, folder, 64 * SMOLLM2.bytes_per_token, args.repeat)
        print(
            "raw: memcpy {memcpy:.0f} MB/s, write+fsync {write_fsync:.0f} MB/s, hot read {read_hot:.0f} MB/s".format(
                **{k: v / 1e6 for k, v in raw.items()}
            )
        )
        cols = [
            "block_MiB",
            "ram_park_MBps",
            "ram_restore_MBps",
            "ram_repark_KiB",
            "disk_park_MBps",
            "disk_written_MBps",
            "disk_restore_MBps",
            "disk_repark_KiB",
            "lookup_ms",
            "unshared_tokens_avg",
        ]
        print("block " + " ".join(f"{c:>18}" for c in cols))
        for block in (int(b) for b in args.blocks.split(",")):
            row = measure_block(block, args.tokens, folder, args.repeat)
            print(f"{block:>5} " + " ".join(f"{row[c]:>18.2f}" for c in cols))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
