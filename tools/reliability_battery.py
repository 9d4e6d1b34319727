"""The reliability battery: start a real `strata serve` on the bundled model and probe it from outside the way a
hostile or unlucky client would; one line per probe, a summary, exit status 0 only if none failed.

    python tools/reliability_battery.py [--quick] [--only NAME[,NAME]] [--clients 8] [--seconds 60]
                                        [--engine-args "--threads 2"] [--keep]

Probes (each on an engine of its own; docs/DEVELOPERS.md says what each proves):
  hostile-bodies         a few hundred malformed and hostile requests: no 5xx, healthy afterwards
  large-prompts          10 and 30 MB prompts, clients that leave: peak RSS, CPU after they leave, SIGTERM
  stalled-connections    half-sent heads and stalled bodies closed within the deadlines; a stream nobody reads
  kill-9-tiered          SIGKILL during parks and writes: no torn file, greedy answers equal a fresh engine's
  full-read-only-folder  a cache folder that fills up, then may not change (root only): serving goes on
  load                   N clients of mixed streaming chats for D seconds: no failure, p50/p95 latency

Lines read `PASS|FAIL|SKIP  name  figures`. --quick runs small sizes and short durations (about a minute and a
half on a 2-core machine). The engines' logs stay in the work folder when a probe fails (or with --keep).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.reliability import crash, disk, hostile, large, load, stalls  # noqa: E402
from tools.reliability.common import Options, Result  # noqa: E402

PROBES: dict[str, Callable[[Options], Result]] = {
    hostile.NAME: hostile.run,
    large.NAME: large.run,
    stalls.NAME: stalls.run,
    crash.NAME: crash.run,
    disk.NAME: disk.run,
    load.NAME: load.run,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes and short durations (CI)")
    parser.add_argument("--only", default="", help=f"comma-separated probes among {', '.join(PROBES)}")
    parser.add_argument("--clients", type=int, default=8, help="load: concurrent clients")
    parser.add_argument("--seconds", type=float, default=None, help="load: duration (default 60, --quick 10)")
    parser.add_argument("--engine-args", default="", help="extra flags for every engine, e.g. \"--threads 2\"")
    parser.add_argument("--seed", type=int, default=7, help="seeds the kill moments and the load's choices")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (engine logs, cache folders)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.only.split(",") if n and n not in PROBES]
    if unknown:
        parser.error(f"--only: unknown probe {', '.join(unknown)}; expected some of {', '.join(PROBES)}")
    return args


def run_probe(name: str, options: Options) -> Result:
    try:
        return PROBES[name](options)
    except Exception as exc:  # noqa: BLE001 - a probe that breaks is a failed probe, and the others still run
        detail = traceback.format_exc(limit=3).strip().splitlines()[-1]
        return Result(name, "FAIL", f"the probe broke: {type(exc).__name__}: {exc} ({detail})"[:2000])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="strata-battery-")
    options = Options(quick=args.quick, engine_args=Options.split_args(args.engine_args), workdir=workdir,
                      load_clients=args.clients, seed=args.seed,
                      load_seconds=args.seconds if args.seconds is not None else (10.0 if args.quick else 60.0))
    names = [n for n in args.only.split(",") if n] or list(PROBES)
    started = time.monotonic()
    results = []
    for name in names:
        t0 = time.monotonic()
        result = run_probe(name, options)
        results.append(result)
        print(f"{result.line()}  [{time.monotonic() - t0:.0f} s]", flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"battery: {len(results)} probes, {counts['PASS']} passed, {counts['FAIL']} failed, "
          f"{counts['SKIP']} skipped in {time.monotonic() - started:.0f} s"
          + (f"; logs in {workdir}" if counts["FAIL"] or args.keep else ""), flush=True)
    if not (counts["FAIL"] or args.keep):
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
