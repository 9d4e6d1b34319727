"""`strata-desktop --install-desktop-entry`: a per-user launcher and icon on Linux (XDG folders)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

APP_ID = "strata-desktop"


def resource_path(name: str) -> Path:
    """A file shipped in desktop/resources/."""
    return Path(str(resources.files("desktop") / "resources" / name))


def data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def launch_command() -> str:
    """How the desktop entry starts the app: the frozen executable, the gui-script, or `python -m desktop`."""
    if getattr(sys, "frozen", False):
        return shlex.quote(sys.executable)
    script = Path(sys.executable).with_name(APP_ID)
    if script.exists():
        return shlex.quote(str(script))
    found = shutil.which(APP_ID)
    if found:
        return shlex.quote(found)
    return f"{shlex.quote(sys.executable)} -m desktop"


def render_entry(exec_line: str, icon: str) -> str:
    template = resource_path(f"{APP_ID}.desktop.in").read_text(encoding="utf-8")
    return template.replace("@EXEC@", exec_line).replace("@ICON@", icon)


def install_desktop_entry(target: Path | None = None) -> list[Path]:
    """Write the icon and the .desktop file under the user's data folder; returns the files written."""
    base = target or data_home()
    icon_dir = base / "icons" / "hicolor" / "scalable" / "apps"
    png_dir = base / "icons" / "hicolor" / "256x256" / "apps"
    apps_dir = base / "applications"
    for d in (icon_dir, png_dir, apps_dir):
        d.mkdir(parents=True, exist_ok=True)
    svg = icon_dir / f"{APP_ID}.svg"
    png = png_dir / f"{APP_ID}.png"
    shutil.copyfile(resource_path(f"{APP_ID}.svg"), svg)
    shutil.copyfile(resource_path(f"{APP_ID}-256.png"), png)
    entry = apps_dir / f"{APP_ID}.desktop"
    entry.write_text(render_entry(launch_command(), APP_ID), encoding="utf-8")
    entry.chmod(0o755)
    if shutil.which("update-desktop-database"):
        subprocess.run(["update-desktop-database", str(apps_dir)], check=False, capture_output=True)
    return [entry, svg, png]
