#!/usr/bin/env bash
# Sets up, then runs Strata Desktop on the bundled model; with no display, runs the engine alone.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ]; then
  exec .venv/bin/strata-desktop "$@"
fi
echo "run: no display found; serving the engine alone on http://127.0.0.1:8080/v1"
exec .venv/bin/strata serve "$@"
