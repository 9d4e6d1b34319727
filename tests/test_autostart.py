"""Start at login: XDG autostart entries for real in a temporary XDG_CONFIG_HOME; the Windows Startup-folder logic
with a temporary folder standing in for the Startup folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from desktop import autostart, files
from desktop.autostart import (
    HIDDEN_FLAG,
    WINDOWS_FALLBACK,
    WINDOWS_LINK,
    Autostart,
    desktop_exec_quote,
    parse_cmd,
    parse_desktop_exec,
    render_cmd,
    shortcut_script,
    split_windows_args,
)


@pytest.fixture
def xdg(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "autostart"


def test_xdg_entry_created_read_back_removed(xdg):
    entry = Autostart(platform="linux", command=["/opt/strata-desktop/strata-desktop"])
    assert entry.folder == xdg
    assert not entry.is_enabled() and entry.read() is None
    path = entry.enable()
    assert path == xdg / "strata-desktop.desktop"
    assert entry.is_enabled()
    assert entry.read() == ["/opt/strata-desktop/strata-desktop", HIDDEN_FLAG]
    text = path.read_text(encoding="utf-8")
    assert "TryExec=/opt/strata-desktop/strata-desktop\n" in text
    assert entry.disable() is True
    assert not path.exists() and not entry.is_enabled()
    assert entry.disable() is False  # nothing left to remove


def test_an_entry_held_open_for_a_moment_is_still_rewritten_and_removed(tmp_path):
    """A real handle held for a moment (as the Settings tab's own read of the entry can cause): where Windows refuses
    the change (a sharing violation) it is tried again until the handle is gone. POSIX lets both through at once, so
    this proves the retry only under Windows (and wine, in scripts/windows-check.sh); the tests after it prove it
    on every OS."""
    import threading

    entry = Autostart(platform="linux", folder=tmp_path, command=["strata-desktop"])
    path = entry.enable()

    def while_held(change):
        held = open(path, encoding="utf-8")  # noqa: SIM115 - the timer closes it while the change waits
        timer = threading.Timer(0.2, held.close)
        timer.start()
        try:
            return change()
        finally:
            timer.join()

    assert while_held(entry.enable) == path and entry.read() == ["strata-desktop", HIDDEN_FLAG]
    assert while_held(entry.disable) is True and not path.exists() and not entry.is_enabled()



class Refusing:
    """Stands in for os.replace or os.unlink where Windows refuses them while another handle holds the entry: the
    first `times` calls that touch `entry` raise the sharing violation's PermissionError, later ones go through."""

    def __init__(self, real, entry: Path, times: int) -> None:
        self.real, self.entry, self.times, self.refused = real, entry, times, 0

    def __call__(self, *paths, **kwargs):
        if Path(paths[-1]) == self.entry and self.refused < self.times:
            self.refused += 1
            raise PermissionError(13, "The process cannot access the file because it is being used by another "
                                      "process", str(paths[-1]))
        return self.real(*paths, **kwargs)


@pytest.fixture
def sharing(monkeypatch):
    """The OS refuses changes to a file held open (Windows), on any OS the test runs on."""
    monkeypatch.setattr(files, "SHARING_VIOLATIONS", True)
    return monkeypatch


def test_a_refused_change_is_tried_again_until_it_goes_through(tmp_path, sharing):
    entry = Autostart(platform="linux", folder=tmp_path, command=["strata-desktop"])
    path = tmp_path / "strata-desktop.desktop"
    replace = Refusing(os.replace, path, times=2)
    sharing.setattr(os, "replace", replace)
    assert entry.enable() == path and entry.read() == ["strata-desktop", HIDDEN_FLAG]
    assert replace.refused == 2 and sorted(tmp_path.iterdir()) == [path]
    unlink = Refusing(os.unlink, path, times=2)
    sharing.setattr(os, "unlink", unlink)
    assert entry.disable() is True and unlink.refused == 2
    assert list(tmp_path.iterdir()) == [] and not entry.is_enabled()


def test_a_change_refused_every_time_fails_clearly_and_leaves_no_temporary_file(tmp_path, sharing):
    sharing.setattr(files, "SHARING_RETRIES", 3)
    entry = Autostart(platform="linux", folder=tmp_path, command=["strata-desktop"])
    path = tmp_path / "strata-desktop.desktop"
    replace = Refusing(os.replace, path, times=1000)
    sharing.setattr(os, "replace", replace)
    with pytest.raises(PermissionError, match=r"strata-desktop\.desktop could not be changed through 3 tries .*being "
                                              r"used by another process.*another program may hold it open"):
        entry.enable()
    assert replace.refused == 3 and list(tmp_path.iterdir()) == []  # no strata-desktop.desktop.tmp left behind
    assert not entry.is_enabled()

    sharing.setattr(os, "replace", replace.real)
    entry.enable()
    unlink = Refusing(os.unlink, path, times=1000)
    sharing.setattr(os, "unlink", unlink)
    with pytest.raises(PermissionError, match="could not be changed through 3 tries"):
        entry.disable()
    assert unlink.refused == 3 and entry.is_enabled()  # still there, as the error says


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path):
    """Where no retry applies (POSIX, or an error other than a sharing violation) the error comes as it was, and the
    temporary file goes with it."""
    entry = Autostart(platform="linux", folder=tmp_path, command=["strata-desktop"])
    (tmp_path / "strata-desktop.desktop").mkdir()  # a folder in the entry's place: the replace cannot succeed
    with pytest.raises(OSError, match="strata-desktop.desktop"):
        entry.enable()
    assert [p.name for p in tmp_path.iterdir()] == ["strata-desktop.desktop"]

def test_xdg_entry_never_duplicated(xdg):
    entry = Autostart(platform="linux", command=["/usr/bin/strata-desktop"])
    for _ in range(3):
        entry.enable()
    assert sorted(p.name for p in xdg.iterdir()) == ["strata-desktop.desktop"]
    # A second instance of the setting (e.g. after the app restarted) sees and rewrites the same entry.
    again = Autostart(platform="linux", command=["/usr/bin/strata-desktop"])
    assert again.is_enabled()
    again.enable()
    assert sorted(p.name for p in xdg.iterdir()) == ["strata-desktop.desktop"]


def test_xdg_entry_disabled_by_the_desktop_counts_as_off(xdg):
    entry = Autostart(platform="linux", command=["/usr/bin/strata-desktop"])
    path = entry.enable()
    path.write_text(path.read_text(encoding="utf-8").replace("X-GNOME-Autostart-enabled=true",
                                                             "X-GNOME-Autostart-enabled=false"), encoding="utf-8")
    assert not entry.is_enabled()
    entry.enable()
    assert entry.is_enabled()


def test_xdg_exec_quoting_round_trips(xdg):
    command = ["/home/a b/Strata $HOME/bin/strata-desktop", "-m", 'quote"and\\back`tick%']
    entry = Autostart(platform="linux", command=command)
    entry.enable()
    assert entry.read() == [*command, HIDDEN_FLAG]
    assert desktop_exec_quote("/usr/bin/strata-desktop") == "/usr/bin/strata-desktop"
    assert parse_desktop_exec('"/a b/c" --hidden') == ["/a b/c", "--hidden"]


@pytest.mark.skipif(not shutil.which("desktop-file-validate"), reason="desktop-file-utils not installed")
def test_xdg_entry_validates(xdg):
    path = Autostart(platform="linux", command=["/opt/Strata Desktop/strata-desktop"]).enable()
    done = subprocess.run(["desktop-file-validate", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "", done.stdout


def test_default_command_starts_this_installation_hidden(xdg):
    entry = Autostart(platform="linux")
    assert entry.command[-1] == HIDDEN_FLAG
    assert Path(entry.command[0]).is_absolute()
    assert entry.command[0] == sys.executable or Path(entry.command[0]).name == "strata-desktop"


def test_the_interpreter_without_a_console_is_chosen_for_windows_only(tmp_path, monkeypatch):
    """A source install with no launcher on PATH starts `python -m desktop`; pythonw.exe (no console window at
    login) is a Windows program, chosen by the platform asked for, not the one the check runs on."""
    folder = tmp_path / "venv" / "bin"
    folder.mkdir(parents=True)
    for name in ("python", "python.exe", "pythonw.exe"):
        (folder / name).write_bytes(b"")
    monkeypatch.setattr(sys, "executable", str(folder / "python"))
    monkeypatch.setattr(autostart.shutil, "which", lambda name: None)
    assert Autostart(platform="linux").command == [str(folder / "python"), "-m", "desktop", HIDDEN_FLAG]
    assert Autostart(platform="win32").command == [str(folder / "pythonw.exe"), "-m", "desktop", HIDDEN_FLAG]
    (folder / "strata-desktop.exe").write_bytes(b"")  # a Windows install's launcher is not a Linux one's
    assert Autostart(platform="linux").command[0] == str(folder / "python")
    assert Autostart(platform="win32").command == [str(folder / "strata-desktop.exe"), HIDDEN_FLAG]


def test_unsupported_platform_is_off():
    entry = Autostart(platform="darwin", command=["/x"])
    assert not entry.supported and not entry.is_enabled()
    with pytest.raises(OSError):
        entry.enable()


# ---------------------------------------------------------------------------------------------- Windows logic


class FakeShell:
    """Stands in for PowerShell's WScript.Shell: records the shortcut and reads it back."""

    def __init__(self, works: bool = True) -> None:
        self.works = works
        self.links: dict[Path, list[str]] = {}

    def write(self, link: Path, target: str, arguments: str, workdir: str, icon: str) -> bool:
        if not self.works:
            return False
        link.write_bytes(b"L\x00\x00\x00")  # a .lnk starts with its header size
        self.links[link] = [target, *split_windows_args(arguments)]
        return True

    def read(self, link: Path) -> list[str] | None:
        return self.links.get(link)


EXE = r"C:\Users\Ana Li\AppData\Local\Programs\Strata Desktop\strata-desktop.exe"


def windows(folder: Path, shell: FakeShell) -> Autostart:
    return Autostart(platform="win32", folder=folder, command=[EXE], shortcut_writer=shell.write,
                     shortcut_reader=shell.read)


def test_windows_startup_folder_from_appdata(monkeypatch, tmp_path):
    monkeypatch.setenv("APPDATA", str(tmp_path / "Roaming"))
    entry = Autostart(platform="win32", command=[EXE])
    assert entry.folder == tmp_path / "Roaming" / "Microsoft" / "Windows" / "Start Menu" / "Programs" / "Startup"
    assert [p.name for p in entry.paths()] == [WINDOWS_LINK, WINDOWS_FALLBACK]


def test_windows_shortcut_created_read_back_removed(tmp_path):
    shell = FakeShell()
    entry = windows(tmp_path, shell)
    assert not entry.is_enabled()
    path = entry.enable()
    assert path == tmp_path / "Strata Desktop.lnk"  # the same name the installer's task uses
    assert entry.is_enabled()
    assert entry.read() == [EXE, HIDDEN_FLAG]
    assert entry.disable() and not entry.is_enabled() and list(tmp_path.iterdir()) == []


def test_windows_never_duplicated_and_fallback_replaced(tmp_path):
    broken = FakeShell(works=False)
    entry = windows(tmp_path, broken)
    path = entry.enable()
    assert path.name == WINDOWS_FALLBACK
    assert entry.read() == [EXE, HIDDEN_FLAG]
    entry.enable()
    assert [p.name for p in tmp_path.iterdir()] == [WINDOWS_FALLBACK]
    # Once a shortcut can be written it replaces the fallback: still one entry.
    shell = FakeShell()
    windows(tmp_path, shell).enable()
    assert [p.name for p in tmp_path.iterdir()] == [WINDOWS_LINK]
    # The installer's shortcut exists and PowerShell fails: it stays the one entry, no .cmd beside it.
    windows(tmp_path, broken).enable()
    assert [p.name for p in tmp_path.iterdir()] == [WINDOWS_LINK]
    assert windows(tmp_path, broken).disable()
    assert list(tmp_path.iterdir()) == []


def test_windows_cmd_and_shortcut_script_quoting():
    command = [EXE, HIDDEN_FLAG]
    text = render_cmd(command)
    assert text.startswith("@echo off\r\nchcp 65001 >nul\r\n")  # the lines after it read as UTF-8
    assert f'start "" "{EXE}" --hidden' in text
    assert parse_cmd(text) == command
    accented = [r"C:\Users\José Müller\Strata Desktop\strata-desktop.exe", HIDDEN_FLAG]
    assert parse_cmd(render_cmd(accented)) == accented
    script = shortcut_script(Path(r"C:\S\Strata Desktop.lnk"), r"C:\it's\strata-desktop.exe", "--hidden",
                             r"C:\it's", r"C:\it's\strata-desktop.exe")
    assert r"$s.TargetPath = 'C:\it''s\strata-desktop.exe'" in script
    assert "$s.Arguments = '--hidden'" in script
    assert split_windows_args(r'"C:\a b\x.exe" --hidden "q\"uote"') == [r"C:\a b\x.exe", "--hidden", 'q"uote']


def test_windows_without_powershell_reads_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(autostart, "powershell", lambda: None)
    assert autostart.write_shortcut(tmp_path / WINDOWS_LINK, EXE, "--hidden", "C:\\", EXE) is False
    assert autostart.read_shortcut(tmp_path / WINDOWS_LINK) is None


def test_windows_old_cmd_entry_rewritten_at_load(tmp_path):
    """A .cmd written before the code-page line is brought up to date when the Settings tab loads, command kept;
    one edited by hand is left alone."""
    accented = [r"C:\Users\José Müller\Strata Desktop\strata-desktop.exe", HIDDEN_FLAG]
    old = render_cmd(accented).replace("chcp 65001 >nul\r\n", "")
    cmd = tmp_path / WINDOWS_FALLBACK
    cmd.write_bytes(old.encode("utf-8"))
    entry = windows(tmp_path, FakeShell(works=False))
    assert entry.load() is True
    assert cmd.read_bytes() == render_cmd(accented).encode("utf-8")  # CRLF line ends kept
    assert entry.read() == accented
    assert [p.name for p in tmp_path.iterdir()] == [WINDOWS_FALLBACK]  # no temporary file left
    edited = old.replace("@echo off\r\n", "@echo off\r\nset STRATA_PORT=9000\r\n")
    cmd.write_bytes(edited.encode("utf-8"))
    assert entry.load() is True
    assert cmd.read_bytes() == edited.encode("utf-8")
