"""The reliability battery (tools/reliability_battery.py) in its --quick form: every probe passes, or is skipped
with its reason where this machine cannot run it (the full and read-only folder needs root); and a probe that
fails makes the battery fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATTERY = os.path.join(REPO, "tools", "reliability_battery.py")
PROBES = ("hostile-bodies", "large-prompts", "stalled-connections", "kill-9-tiered", "full-read-only-folder", "load")
LINE = re.compile(r"^(PASS|FAIL|SKIP)\s+(\S+)\s+(.*)$", re.MULTILINE)


def battery(*args: str, timeout: float = 600) -> tuple[int, dict[str, tuple[str, str]], str]:
    """(exit status, {probe: (status, figures)}, output) of one run."""
    proc = subprocess.run([sys.executable, BATTERY, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    return proc.returncode, {m.group(2): (m.group(1), m.group(3)) for m in LINE.finditer(proc.stdout)}, output


@pytest.mark.slow
def test_every_probe_of_the_quick_battery_passes():
    status, probes, output = battery("--quick")
    assert sorted(probes) == sorted(PROBES), output
    for name, (outcome, figures) in probes.items():
        assert outcome == "PASS" or (outcome == "SKIP" and figures.strip()), f"{name}: {outcome} {figures}"
    assert status == 0, output
    assert re.search(r"^battery: 6 probes, \d passed, 0 failed", output, re.MULTILINE), output


@pytest.mark.slow
def test_a_failing_probe_fails_the_battery():
    # Behind an API key the load's clients (which send none) are all refused: the probe must say so.
    status, probes, output = battery("--only", "load", "--seconds", "2", "--engine-args", "--api-key secret")
    assert probes["load"][0] == "FAIL" and "failures" in probes["load"][1], output
    assert status == 1, output
