"""Start at login: an XDG autostart entry on Linux, a shortcut in the Startup folder on Windows.

Launched that way the app starts hidden in the tray (`--hidden`) and starts its engine. The entry's presence
is the setting: nothing else records it, so the Settings tab, the Windows installer's "start at login" task and
a user deleting the file by hand never disagree. Enabling twice rewrites the one entry; disabling removes every
form this module or the installer may have written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from desktop.files import atomic_write, while_shared

APP_ID = "strata-desktop"
APP_NAME = "Strata Desktop"
HIDDEN_FLAG = "--hidden"
# Windows: the installer's task and this module write the same name, so there is never a second entry.
WINDOWS_LINK = f"{APP_NAME}.lnk"
WINDOWS_FALLBACK = f"{APP_NAME}.cmd"  # used when no PowerShell can write a .lnk
CMD_CODE_PAGE = "chcp 65001 >nul\r\n"  # the .cmd's lines after it read as UTF-8


def app_command(platform: str | None = None) -> list[str]:
    """The program (and leading arguments) that starts the desktop app on this installation, for `platform`
    (sys.platform's spelling; default: this one)."""
    windows = (platform or sys.platform) == "win32"
    if getattr(sys, "frozen", False):
        return [sys.executable]
    exe = Path(sys.executable)
    script = exe.with_name(f"{APP_ID}.exe" if windows else APP_ID)
    if script.is_file():
        return [str(script)]
    found = shutil.which(APP_ID)
    if found:
        return [found]
    if windows and exe.with_name("pythonw.exe").is_file():
        exe = exe.with_name("pythonw.exe")  # no console window at login
    return [str(exe), "-m", "desktop"]


# ---------------------------------------------------------------------------------------------- Linux (XDG)


def xdg_autostart_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or ""
    return (Path(base) if os.path.isabs(base) else Path.home() / ".config") / "autostart"


_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


def desktop_exec_quote(arg: str) -> str:
    """Quote one argument for a desktop entry's Exec key (freedesktop Desktop Entry spec, "The Exec key")."""
    if arg and not (_RESERVED & set(arg)) and "%" not in arg and "=" not in arg:
        return arg
    inner = "".join("\\" + c if c in '"`$\\' else c for c in arg).replace("%", "%%")
    return f'"{inner}"'


def desktop_value_escape(value: str) -> str:
    """Escape a string value for a desktop entry (backslashes, newlines)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def parse_desktop_exec(value: str) -> list[str]:
    """The arguments of an Exec value written by `desktop_exec_quote` (after un-escaping the string value)."""
    raw = value.replace("\\\\", "\x00").replace("\\n", "\n").replace("\\t", "\t").replace("\x00", "\\")
    args: list[str] = []
    cur: list[str] = []
    quoted = have = False
    i = 0
    while i < len(raw):
        c = raw[i]
        if quoted and c == "\\" and i + 1 < len(raw) and raw[i + 1] in '"`$\\':
            cur.append(raw[i + 1])
            i += 2
            continue
        if c == '"':
            quoted, have = not quoted, True
        elif c in " \t\n" and not quoted:
            if have:
                args.append("".join(cur))
            cur, have = [], False
        else:
            cur.append(c)
            have = True
        i += 1
    if have:
        args.append("".join(cur))
    return [a.replace("%%", "%") for a in args]


def render_xdg_entry(command: list[str]) -> str:
    exec_value = desktop_value_escape(" ".join(desktop_exec_quote(a) for a in command))
    return "\n".join([
        "[Desktop Entry]",
        "Type=Application",
        "Version=1.4",
        f"Name={APP_NAME}",
        "Comment=Start Strata Desktop in the tray at login, with the engine serving",
        f"Exec={exec_value}",
        f"TryExec={desktop_value_escape(command[0])}",  # skipped at login once the app is uninstalled
        f"Icon={APP_ID}",
        "Terminal=false",
        "Categories=Development;",
        "X-GNOME-Autostart-enabled=true",
        "",
    ])


def read_desktop_key(text: str, key: str) -> str | None:
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Desktop Entry]" and "=" in line:
            k, _, v = line.partition("=")
            if k.strip() == key:
                return v.strip()
    return None


# ---------------------------------------------------------------------------------------------- Windows


def windows_startup_dir() -> Path:
    """The user's Startup folder (what Inno Setup calls {userstartup})."""
    appdata = os.environ.get("APPDATA") or str(Path.home() / "AppData" / "Roaming")
    return Path(appdata) / "Microsoft" / "Windows" / "Start Menu" / "Programs" / "Startup"


def _ps_quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def windows_arguments(args: list[str]) -> str:
    return subprocess.list2cmdline(args)


def powershell() -> str | None:
    return shutil.which("powershell") or shutil.which("pwsh")


def shortcut_script(link: Path, target: str, arguments: str, workdir: str, icon: str) -> str:
    """PowerShell that writes a .lnk through WScript.Shell."""
    return "; ".join([
        "$ErrorActionPreference = 'Stop'",
        f"$s = (New-Object -ComObject WScript.Shell).CreateShortcut({_ps_quote(str(link))})",
        f"$s.TargetPath = {_ps_quote(target)}",
        f"$s.Arguments = {_ps_quote(arguments)}",
        f"$s.WorkingDirectory = {_ps_quote(workdir)}",
        f"$s.IconLocation = {_ps_quote(icon + ',0')}",
        f"$s.Description = {_ps_quote(APP_NAME + ' (in the tray)')}",
        "$s.WindowStyle = 7",  # minimised
        "$s.Save()",
    ])


def _run_powershell(script: str) -> subprocess.CompletedProcess[str] | None:
    exe = powershell()
    if exe is None:
        return None
    flags = 0x08000000 if os.name == "nt" else 0  # CREATE_NO_WINDOW
    try:
        return subprocess.run([exe, "-NoProfile", "-NonInteractive", "-Command", script], capture_output=True,
                              text=True, timeout=30, check=False, creationflags=flags)
    except (OSError, subprocess.TimeoutExpired):
        return None


def write_shortcut(link: Path, target: str, arguments: str, workdir: str, icon: str) -> bool:
    """Write a .lnk; False when no PowerShell could do it."""
    done = _run_powershell(shortcut_script(link, target, arguments, workdir, icon))
    return done is not None and done.returncode == 0 and link.is_file()


def read_shortcut(link: Path) -> list[str] | None:
    """[target, *arguments] of a .lnk, through PowerShell; None when it cannot be read."""
    script = (f"$s = (New-Object -ComObject WScript.Shell).CreateShortcut({_ps_quote(str(link))}); "
              "Write-Output $s.TargetPath; Write-Output $s.Arguments")
    done = _run_powershell(script)
    if done is None or done.returncode != 0:
        return None
    lines = done.stdout.splitlines() + ["", ""]
    return [lines[0].strip(), *split_windows_args(lines[1].strip())]


def split_windows_args(text: str) -> list[str]:
    """Split a Windows command line as CommandLineToArgvW does for the cases list2cmdline produces."""
    args, cur, quoted, have, i = [], [], False, False, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            n = 0
            while i < len(text) and text[i] == "\\":
                n += 1
                i += 1
            if i < len(text) and text[i] == '"':
                cur.append("\\" * (n // 2))
                if n % 2:
                    cur.append('"')
                    i += 1
            else:
                cur.append("\\" * n)
            have = True
            continue
        if c == '"':
            quoted = not quoted
            have = True
        elif c in " \t" and not quoted:
            if have:
                args.append("".join(cur))
                cur, have = [], False
        else:
            cur.append(c)
            have = True
        i += 1
    if have:
        args.append("".join(cur))
    return args


def render_cmd(command: list[str]) -> str:
    """The fallback: a .cmd that starts the app detached (a console flashes briefly at login). It is written in
    UTF-8, and cmd.exe reads a batch file's lines in the console's code page (an OEM one, 437 or 850, say), so
    it switches that to UTF-8 first: a path with a letter outside ASCII (C:\\Users\\José\\...) then reaches
    `start` as written."""
    return f'@echo off\r\n{CMD_CODE_PAGE}start "" {windows_arguments(command)}\r\n'


def parse_cmd(text: str) -> list[str] | None:
    for line in text.splitlines():
        line = line.strip()
        if line.lower().startswith('start ""'):
            return split_windows_args(line[len('start ""'):].strip())
    return None


# ---------------------------------------------------------------------------------------------- the setting


class Autostart:
    """The "Start at login" entry for this user. `platform`, `folder` and `command` are for tests."""

    def __init__(self, platform: str | None = None, folder: Path | None = None,
                 command: list[str] | None = None,
                 shortcut_writer: Callable[[Path, str, str, str, str], bool] | None = None,
                 shortcut_reader: Callable[[Path], list[str] | None] | None = None) -> None:
        self.platform = platform or sys.platform
        self.windows = self.platform == "win32"
        self._folder = folder
        self.command = [*(command or app_command(self.platform)), HIDDEN_FLAG]
        self._write_shortcut = shortcut_writer or write_shortcut
        self._read_shortcut = shortcut_reader or read_shortcut

    @property
    def supported(self) -> bool:
        return self.windows or self.platform.startswith(("linux", "freebsd", "openbsd", "netbsd"))

    @property
    def folder(self) -> Path:
        if self._folder is not None:
            return self._folder
        return windows_startup_dir() if self.windows else xdg_autostart_dir()

    def paths(self) -> list[Path]:
        """Every file that may hold the entry, the preferred form first."""
        if self.windows:
            return [self.folder / WINDOWS_LINK, self.folder / WINDOWS_FALLBACK]
        return [self.folder / f"{APP_ID}.desktop"]

    def existing(self) -> list[Path]:
        return [p for p in self.paths() if p.is_file()]

    def is_enabled(self) -> bool:
        if not self.supported:
            return False
        return any(self.windows or self._xdg_active(path) for path in self.existing())

    def load(self) -> bool:
        """is_enabled, for the Settings tab at start, after a .cmd entry exactly as an older version wrote it is
        rewritten in today's form, its command kept: the code-page line before `start`, without which cmd.exe reads
        a non-ASCII path in the console's code page. A file edited by hand is left as it is; a rewrite that fails
        leaves the old entry, which still works for an ASCII path."""
        fallback = self.paths()[-1] if self.windows else None
        if fallback is not None and fallback.is_file():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                text = fallback.read_bytes().decode("utf-8")  # as written: CRLF kept
                command = parse_cmd(text)
                if command and text == render_cmd(command).replace(CMD_CODE_PAGE, ""):
                    atomic_write(fallback, render_cmd(command), newline="")
        return self.is_enabled()

    def _xdg_active(self, path: Path) -> bool:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return False
        hidden = (read_desktop_key(text, "Hidden") or "").lower() == "true"
        enabled = (read_desktop_key(text, "X-GNOME-Autostart-enabled") or "true").lower() != "false"
        return not hidden and enabled

    def read(self) -> list[str] | None:
        """The command the entry starts, or None when there is none (or it cannot be read)."""
        for path in self.existing():
            try:
                if path.suffix == ".desktop":
                    value = read_desktop_key(path.read_text(encoding="utf-8"), "Exec")
                    return parse_desktop_exec(value) if value is not None else None
                if path.suffix == ".cmd":
                    return parse_cmd(path.read_text(encoding="utf-8", errors="replace"))
                if path.suffix == ".lnk":
                    return self._read_shortcut(path)
            except (OSError, ValueError, UnicodeDecodeError):
                return None
        return None

    def enable(self) -> Path:
        """Create (or rewrite) the one entry; returns its path. Raises OSError when it cannot be written."""
        if not self.supported:
            raise OSError(f"start at login is not supported on {self.platform}")
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.windows:
            return self._enable_windows()
        path = self.paths()[0]
        atomic_write(path, render_xdg_entry(self.command), newline="")
        return path

    def _enable_windows(self) -> Path:
        link, fallback = self.paths()
        target, args = self.command[0], self.command[1:]
        workdir = str(Path(target).parent)
        if self._write_shortcut(link, target, windows_arguments(args), workdir, target):
            # An old .cmd entry, perhaps open in an editor; if it stays, the error says so and the Settings tab shows
            # the entries on disk (the new shortcut is one).
            with contextlib.suppress(FileNotFoundError):
                while_shared(fallback.unlink, fallback)
            return link
        if link.is_file():
            return link  # an existing shortcut (e.g. the installer's) stays the one entry
        atomic_write(fallback, render_cmd(self.command), newline="")
        return fallback

    def disable(self) -> bool:
        """Remove the entry in every form; True when something was removed."""
        removed = False
        for path in self.existing():
            while_shared(path.unlink, path)
            removed = True
        return removed

    def set_enabled(self, on: bool) -> None:
        if on:
            self.enable()
        else:
            self.disable()
