#!/usr/bin/env bash
# Builds the native CPU kernels' libraries into engine/model/kernels/ (what the wheel, the PyInstaller bundle, the
# .deb and the Windows installer carry; engine/model/kernels/build.py has the compilers and flags), then shows what
# each one needs at run time. Libraries already built for the current sources are kept.
#   scripts/build-kernels.sh                            this machine's platform (linux-x86_64 here)
#   scripts/build-kernels.sh --target windows-x86_64    the Windows DLLs, with MinGW-w64 (gcc-mingw-w64-x86-64-win32)
#   scripts/build-kernels.sh --target linux-aarch64     the ARM64 build, with gcc-aarch64-linux-gnu
#   scripts/build-kernels.sh --target all               all three
# Other options go to build.py (--out DIR, --cc COMPILER, --variant NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
targets=()
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) targets+=("$2"); shift ;;
    *) args+=("$1") ;;
  esac
  shift
done
[ ${#targets[@]} -gt 0 ] || targets=("$("$PYTHON" -c 'import sys; sys.path.insert(0, "engine/model/kernels"); import build; print(build.host_name())')")
[ "${targets[0]}" != all ] || targets=(linux-x86_64 windows-x86_64 linux-aarch64)
out=engine/model/kernels
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[$i]}" != --out ] || out="${args[$((i + 1))]}"; done

for target in "${targets[@]}"; do
  "$PYTHON" engine/model/kernels/build.py --target "$target" ${args[@]+"${args[@]}"}
  for lib in "$out"/_strata_kernels-"$target"-*; do
    case "$target" in
      windows-*) needs="$(x86_64-w64-mingw32-objdump -p "$lib" | sed -n 's/^\tDLL Name: //p' | tr '\n' ' ')" ;;
      *) needs="$(objdump -p "$lib" | sed -n 's/^ *NEEDED *//p' | tr '\n' ' ')" ;;
    esac
    echo "build-kernels: $(basename "$lib") needs: $needs"
  done
done
