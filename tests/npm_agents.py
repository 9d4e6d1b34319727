"""Agent command-line programs from npm for the slow tests, installed once per version under
~/.cache/strata-tests/agents/<package>-<version> and reused; skipped only where node or npm is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "strata-tests", "agents")
NPM_TIMEOUT_S = 600


def install(package: str, version: str, command: str) -> str:
    """The launcher `command` of `package@version`. Installed into a temporary folder first and moved into place
    once `command --version` runs, so an interrupted install is never reused."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(f"node and npm are needed to install {package}")
    folder = os.path.join(CACHE, f"{package.strip('@').replace('/', '-')}-{version}")
    launcher = os.path.join(folder, "node_modules", ".bin", command)
    if not os.path.exists(launcher):
        os.makedirs(CACHE, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".install-", dir=CACHE)
        downloads = tempfile.mkdtemp(prefix=".npm-cache-", dir=CACHE)  # npm's own cache: hundreds of MiB, not kept
        try:
            done = subprocess.run(["npm", "install", "--prefix", staging, "--cache", downloads, "--no-audit", "--no-fund",
                                   "--no-update-notifier", f"{package}@{version}"],
                                  capture_output=True, text=True, timeout=NPM_TIMEOUT_S, stdin=subprocess.DEVNULL)
            assert done.returncode == 0, f"npm install {package}@{version} failed:\n{done.stdout}\n{done.stderr}"
            os.chmod(staging, 0o755)
            try:
                os.rename(staging, folder)
            except OSError:  # another run installed it meanwhile
                if not os.path.exists(launcher):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(downloads, ignore_errors=True)
    done = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0 and version in done.stdout, f"{launcher} --version: {done.stdout}{done.stderr}"
    return launcher
