#!/usr/bin/env bash
# Sets up, then runs ruff, mypy, the import contracts and every test (GUI tests under a virtual X screen).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
PYTHONPATH=. .venv/bin/mypy  # engine/, as [tool.mypy] in pyproject.toml says
PYTHONPATH=. .venv/bin/lint-imports  # the import contracts in pyproject.toml (this checkout, not an installed copy)
exec .venv/bin/python -m pytest -p no:cacheprovider --durations=30 "$@"  # the 30 slowest tests listed at the end
