# The installer step of scripts/windows-check.sh, run with 32-bit wine (on the machine, or in its bookworm chroot)
# with WINEPREFIX set to the check's prefix32. Arguments: SETUP_EXE (a Windows path: the check's variant of the
# installer, see step_setup), PORT, CACHE.
# Installs silently and per user, starts the installed strata-desktop.exe's engine and has it answer a chat, then
# uninstalls silently and checks that the program folder is gone. Last line: "installer: <summary>".
set -euo pipefail
trap 'echo "installer: failed at line $LINENO: $BASH_COMMAND"' ERR
setup=$1 port=$2 cache=$3
start=$SECONDS

# A virtual X screen: setup.exe and the uninstaller create their (hidden) windows even when silent.
for n in $(seq 91 140); do
  [ -e "/tmp/.X$n-lock" ] && continue
  Xvfb ":$n" -screen 0 1024x768x24 -nolisten tcp >/dev/null 2>&1 &
  xvfb=$!
  export DISPLAY=":$n"
  break
done
trap 'wineserver -k >/dev/null 2>&1 || true; kill "$xvfb" 2>/dev/null || true' EXIT
sleep 1

wineserver -p >/dev/null 2>&1 </dev/null || true
wine cmd.exe /c exit >/dev/null 2>&1 </dev/null || true  # creates the prefix on first use; see wineserver_up
# A new wow64 prefix of Debian's wine 8.0 says it is Windows 7, which strata.iss refuses (MinVersion=10.0).
wine winecfg.exe -v win10 >/dev/null 2>&1 </dev/null
# The stand-in DLLs (scripts/windows/*.c) for what wine lacks and Windows has.
cp "$cache"/dlls/*.dll "$WINEPREFIX/drive_c/windows/system32/"

user_dir="$(wine cmd.exe /c 'echo %LOCALAPPDATA%' 2>/dev/null | tr -d '\r' | tail -1)"
# Where strata.iss installs, {autopf}\Strata Desktop: {autopf} is %LOCALAPPDATA%\Programs for a per-user install.
target="$user_dir\\Programs\\Strata Desktop"
unix_target="$(wine winepath.exe -u "$target" 2>/dev/null | tr -d '\r' | tail -1)"
rm -rf "$unix_target"

t0=$SECONDS
status=0
wine "$setup" /VERYSILENT /SUPPRESSMSGBOXES /NORESTART /CURRENTUSER "/LOG=C:\\setup.log" 2>&1 | cat || status=$?
if [ "$status" != 0 ]; then
  tr -d '\r' <"$WINEPREFIX/drive_c/setup.log" | tail -8
  echo "installer: setup.exe exited with $status: $(tr -d '\r' <"$WINEPREFIX/drive_c/setup.log" | grep -v 'Log closed\|Deinitializing' | tail -1 | cut -c25-)"
  exit 1
fi
install_s=$((SECONDS - t0))
exe="$unix_target/strata-desktop.exe"
if [ ! -f "$exe" ]; then
  tr -d '\r' <"$WINEPREFIX/drive_c/setup.log" | tail -20 || true
  echo "installer: setup.exe installed nothing in $target"; exit 1
fi
size=$(du -sm "$unix_target" | cut -f1)
shortcut=$(find "$WINEPREFIX/drive_c/users" -path '*Start Menu*' -name 'Strata Desktop.lnk' | head -1)
[ -n "$shortcut" ] || { echo "installer: no Start-menu shortcut"; exit 1; }

# The installed program started as the app starts its engine (`strata-desktop.exe serve`), answering a chat.
(wine "$exe" serve --port "$port" 2>&1 | cat >"$cache/logs/installer-serve.log") &
serve=$!
if ! python3 "$cache/run/smoke.py" answer "http://127.0.0.1:$port" >"$cache/run/installed.json" 2>&1; then
  cat "$cache/run/installed.json" "$cache/logs/installer-serve.log"
  echo "installer: the installed engine did not answer: $(tail -1 "$cache/run/installed.json")"; exit 1
fi
wait "$serve"
answered="$(tail -1 "$cache/run/installed.json")"

t0=$SECONDS
uninstaller="$(ls "$unix_target"/unins*.exe | head -1)"
wine "$uninstaller" /VERYSILENT /SUPPRESSMSGBOXES /NORESTART 2>&1 | cat
# The uninstaller returns at once: it runs on from a copy in %TEMP%, so its work is waited for here.
for _ in $(seq 120); do [ -e "$exe" ] || break; sleep 1; done
for _ in $(seq 30); do [ -e "$unix_target/unins000.exe" ] || break; sleep 1; done
if [ -e "$exe" ]; then echo "installer: the uninstaller left $exe"; exit 1; fi
left=""
[ -d "$unix_target" ] && left=" (an empty folder left: $(find "$unix_target" | wc -l) entries)"
[ -n "$(find "$WINEPREFIX/drive_c/users" -path '*Start Menu*' -name 'Strata Desktop.lnk')" ] && { echo "installer: the Start-menu shortcut stayed"; exit 1; }
echo "installer: installed silently in ${install_s} s (${size} MiB, Start-menu shortcut); installed engine: $answered; uninstalled in $((SECONDS - t0)) s$left; $((SECONDS - start)) s in all"
