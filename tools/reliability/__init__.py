"""The reliability battery: a real `strata serve` probed from outside the way a hostile or unlucky client would.

One module per probe family (hostile bodies, large prompts, stalled connections, kill -9 in tiered mode, a full
and read-only cache folder, load); `tools/reliability_battery.py` runs them and prints one line each.
"""
