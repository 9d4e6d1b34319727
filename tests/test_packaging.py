"""The Linux packages: build them (packaging/build_linux.sh), then run the frozen engine and the frozen GUI, and
install the .deb into a scratch root. Slow: the build takes one to two minutes."""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = "strata-desktop"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux packages build on Linux"),
]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Iterator[Path]:
    for tool in ("dpkg-deb", "objdump"):
        assert shutil.which(tool), f"{tool} is needed to build the packages (scripts/setup.sh installs it)"
    out = tmp_path_factory.mktemp("dist")
    started = time.monotonic()
    done = subprocess.run([str(ROOT / "packaging" / "build_linux.sh"), "--dist", str(out), "--python", sys.executable],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    elapsed = time.monotonic() - started
    bundle_mib = sum(f.stat().st_size for f in (out / APP).rglob("*") if f.is_file() and not f.is_symlink()) / 2**20
    print(f"\nbuild_linux.sh: {elapsed:.0f} s, bundle {bundle_mib:.0f} MiB, "
          + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.0f} MiB" for p in sorted(out.glob(f"{APP}*.*"))))
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 1.5 GiB: not left for the rest of the run


@pytest.fixture(scope="module")
def executable(dist) -> Path:
    exe = dist / APP / APP
    assert exe.is_file() and os.access(exe, os.X_OK)
    return exe


def scratch_env(tmp_path: Path) -> dict[str, str]:
    """The user's folders in tmp_path; no display (offscreen Qt); the engine on any free port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "PYTHON", "QT_", "XDG_"))}
    for name in ("config", "state", "cache", "data"):
        (tmp_path / name).mkdir(exist_ok=True)
    env.update(
        HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_STATE_HOME=str(tmp_path / "state"),
        XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_DATA_HOME=str(tmp_path / "data"),
        QT_QPA_PLATFORM="offscreen", STRATA_PORT="0",
    )
    env.pop("DISPLAY", None)
    env.pop("WAYLAND_DISPLAY", None)
    return env


class Output:
    """Reads a child's merged output on a thread (a full pipe would block it); waits for a pattern."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    m = regex.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "\n".join(self.lines[-40:]))
                self._changed.wait(left)

    def text(self) -> str:
        return "\n".join(self.lines)


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout} s")


def test_frozen_engine_answers_a_chat_completion(executable, tmp_path):
    from openai import OpenAI

    proc = subprocess.Popen([str(executable), "serve", "--port", "0"], env=scratch_env(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = Output(proc.stdout)
    try:
        url = out.wait_for(r"strata: listening on (http://\S+)", 60).group(1)
        wait_healthy(url, 120)
        client = OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.chat.completions.create(model="local", max_tokens=12,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content.strip()
        assert reply.usage.completion_tokens > 0
        assert "SmolLM2" in reply.model  # the bundled model, found inside the bundle
        assert httpx.post(url + "/shutdown", timeout=5).status_code in (200, 202)
        assert proc.wait(timeout=60) == 0, out.text()
        # the native kernels prebuilt inside the bundle, whatever compiler this machine has
        assert "native kernels unavailable" not in out.text(), out.text()
        assert re.search(r"native kernels: \w+ build, \w+ threads, prebuilt: .*_internal", out.text()), out.text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_frozen_gui_starts_its_engine_and_quits_leaving_no_process(executable, tmp_path):
    env = scratch_env(tmp_path)
    state = tmp_path / "state" / "strata"
    app = subprocess.Popen([str(executable), "--config-dir", str(tmp_path / "config" / "strata"),
                            "--state-dir", str(state)],
                           env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    out = Output(app.stdout)
    pid_file = state / "engine.pid"
    family: list[psutil.Process] = []
    try:
        # The app writes the engine's pid and URL once the engine listens (its orphan check reads the same file).
        deadline = time.monotonic() + 90
        record = None
        while time.monotonic() < deadline and app.poll() is None:
            try:
                record = json.loads(pid_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                record = None
            if record and record.get("url"):
                break
            time.sleep(0.2)
        assert record and record.get("url"), f"no engine URL in {pid_file}:\n{out.text()}"
        assert record["app_pid"] == app.pid
        engine = psutil.Process(record["pid"])
        assert engine.ppid() == app.pid
        cmd = engine.cmdline()
        assert Path(cmd[0]).resolve() == executable.resolve() and cmd[1] == "serve", cmd  # the same executable
        wait_healthy(record["url"], 120)
        family = [psutil.Process(app.pid), *psutil.Process(app.pid).children(recursive=True)]
        # Quit the way the desktop session does: SIGTERM runs the app's quit path (engine stopped via /shutdown).
        quit_started = time.monotonic()
        app.send_signal(signal.SIGTERM)
        assert app.wait(timeout=60) == 0, out.text()
        gone, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"left running: {alive}\n{out.text()}"
        # The engine stopped itself, well inside the 90 s the app gives its clean stop before it kills it.
        assert time.monotonic() - quit_started < 15
        assert not pid_file.exists()
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_tarball_holds_the_bundle(dist):
    (tar_path,) = dist.glob(f"{APP}-*-linux-x86_64.tar.gz")
    with tarfile.open(tar_path) as tar:
        names = set(tar.getnames())
    assert f"{APP}/{APP}" in names
    assert any(n.startswith(f"{APP}/_internal/models/") and n.endswith(".gguf") for n in names)
    assert f"{APP}/_internal/desktop/resources/{APP}.svg" in names
    # every build of the native kernels for these sources, and what names them (their digest's inputs)
    from engine.model.kernels import build

    kernels = f"{APP}/_internal/engine/model/kernels/"
    target = build.target("linux-x86_64")
    for variant in target.variants:
        assert kernels + build.library_name(target, variant, build.digest()) in names, variant
    assert {kernels + f for f in (*build.SOURCES, *build.HEADERS, "build.py")} <= names


def test_deb_installs_a_valid_launcher_for_the_installed_executable(dist, tmp_path):
    (deb,) = dist.glob(f"{APP}_*.deb")
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    fields = subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True, text=True).stdout
    depends = re.search(r"^Depends: (.*)$", fields, re.M).group(1)
    for needed in ("libgl1", "libegl1", "fonts-dejavu-core", "libfontconfig1"):
        assert re.search(rf"(^|[ ,|]){re.escape(needed)}($|[ ,(])", depends), depends

    entry = root / "usr" / "share" / "applications" / f"{APP}.desktop"
    if shutil.which("desktop-file-validate"):
        done = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
        assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    else:
        pytest.fail("desktop-file-validate is missing (desktop-file-utils; scripts/setup.sh installs it)")
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read(entry, encoding="utf-8")
    desktop = parser["Desktop Entry"]
    program = desktop["Exec"].split()[0]
    assert program == f"/opt/{APP}/{APP}" == desktop["TryExec"]
    installed = root / program.lstrip("/")
    assert installed.is_file() and os.access(installed, os.X_OK)
    link = root / "usr" / "bin" / APP
    assert link.is_symlink() and os.readlink(link) == program
    assert desktop["Icon"] == APP
    for size in ("32x32", "64x64", "256x256"):
        assert (root / "usr/share/icons/hicolor" / size / "apps" / f"{APP}.png").is_file()
    assert (root / "usr/share/icons/hicolor/scalable/apps" / f"{APP}.svg").is_file()
    assert list((root / f"opt/{APP}/_internal/models").glob("*.gguf"))
    # Nothing outside the package's own folders; removal scripts never touch a user's folders.
    assert sorted(p.name for p in root.iterdir()) == ["opt", "usr"]
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    for script in control.glob("post*"):
        text = script.read_text(encoding="utf-8")
        assert "rm " not in text and "$HOME" not in text and "/home" not in text, script.name
