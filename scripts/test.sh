#!/usr/bin/env bash
# Sets up, then runs every test (GUI tests under a virtual X screen), and ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
