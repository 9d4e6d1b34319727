"""The native kernels as shipped: the Windows DLLs cross-built with MinGW-w64 export the kernels and need nothing
beyond what Windows has, byte for byte the same from the same sources; the wheel holds its platform's libraries
and is tagged for that platform only; the ARM64 build is an ARM64 library computing this machine's bits (under
QEMU, where it is installed). Slow: each builds the libraries."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from engine.model.kernels import build

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = build.target("windows-x86_64")
# What Windows itself has: its kernel and C runtime. No libgomp-1.dll, libwinpthread-1.dll or libgcc_s_seh-1.dll.
WINDOWS_OWN = {"KERNEL32.dll", "msvcrt.dll"}


def _objdump(tool: str, path: str) -> str:
    return subprocess.run([tool, "-p", path], check=True, capture_output=True, text=True).stdout


def _linux_exports() -> set[str]:
    """The symbols the Linux build exports (the loader's names; -fvisibility=hidden keeps the rest in)."""
    linux = build.target(build.host_name())
    lib = ROOT / "engine" / "model" / "kernels" / build.library_name(linux, "generic", build.digest())
    if not lib.is_file():
        build.build(linux, str(lib.parent), ("generic",))
    table = subprocess.run(["objdump", "-T", str(lib)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in table.splitlines() if " g " in line and ".text" in line}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cross-built on Linux")
def test_the_windows_dlls_export_the_kernels_and_need_only_windows_own_dlls(tmp_path):
    objdump = shutil.which("x86_64-w64-mingw32-objdump")
    if build.find_compiler(WINDOWS) is None or objdump is None:
        pytest.fail("MinGW-w64 builds the Windows DLLs (gcc-mingw-w64-x86-64-win32; scripts/setup.sh installs it)")
    paths = build.build(WINDOWS, str(tmp_path / "a"))
    exports = _linux_exports()
    assert {"q4_matmul", "decode_step", "step_layout", "blocks_cpu_ok", "kernels_isa"} <= exports
    for path, variant in zip(paths, WINDOWS.variants, strict=True):
        text = _objdump(objdump, path)
        assert "file format pei-x86-64" in text, path
        assert set(re.findall(r"DLL Name: (\S+)", text)) <= WINDOWS_OWN, text
        table = text.split("[Ordinal/Name Pointer] Table")[1].split("\n\n")[0]
        assert set(re.findall(r"\] (\w+)", table)) == exports, (variant, table)
    # the same sources give the same bytes
    again = build.build(WINDOWS, str(tmp_path / "b"), ("avx2",))[0]
    assert Path(again).read_bytes() == Path(paths[1]).read_bytes()


def test_the_arm64_build_is_an_arm64_library_computing_the_same_bits(tmp_path):
    arm = build.target("linux-aarch64")
    if build.find_compiler(arm) is None:
        pytest.skip("no aarch64-linux-gnu-gcc here (the ARM64 build is optional)")
    (path,) = build.build(arm, str(tmp_path))
    header = subprocess.run(["readelf", "-h", path], check=True, capture_output=True, text=True).stdout
    assert re.search(r"Machine:\s+AArch64", header) and path.endswith("-generic-" + build.digest() + ".so")
    sysroot = Path("/usr/aarch64-linux-gnu")
    if not shutil.which("qemu-aarch64") or not sysroot.is_dir() or build.host_name() != "linux-x86_64":
        pytest.skip("no qemu-aarch64 to run it (qemu-user)")
    # every build here and the ARM64 one under QEMU (whose FMA is IEEE's): one hash of all their products' bits
    source = ROOT / "tests" / "native_kernels_hash.c"
    subprocess.run(["cc", "-O2", "-o", tmp_path / "hash", source, "-ldl"], check=True)
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-o", tmp_path / "hash-arm64", source, "-ldl"], check=True)
    here = build.target(build.host_name())
    hashes = {v: subprocess.run([tmp_path / "hash", p], check=True, capture_output=True, text=True).stdout
              for v, p in zip(here.variants, build.build(here, str(tmp_path / "x86")), strict=True)}
    hashes["arm64"] = subprocess.run(["qemu-aarch64", "-L", str(sysroot), tmp_path / "hash-arm64", path], check=True,
                                     capture_output=True, text=True, timeout=600).stdout
    assert len(set(hashes.values())) == 1, hashes


def _wheel(out: Path, target: str | None = None) -> Path:
    env = dict(os.environ)
    if target:
        env["STRATA_KERNELS_TARGET"] = target
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(out)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.skipif(build.host_name() != "linux-x86_64", reason="the Linux x86-64 wheel")
def test_the_wheel_holds_its_platforms_libraries(tmp_path):
    digest = build.digest()
    kernels = "engine/model/kernels/"
    for target, tag in (("linux-x86_64", "linux_x86_64"), ("windows-x86_64", "win_amd64")):
        if target == "windows-x86_64" and build.find_compiler(WINDOWS) is None:
            pytest.fail("MinGW-w64 builds the Windows DLLs (gcc-mingw-w64-x86-64-win32; scripts/setup.sh installs it)")
        wheel = _wheel(tmp_path / target, None if target == build.host_name() else target)
        assert wheel.name.endswith(f"-py3-none-{tag}.whl"), wheel.name  # any Python 3, this platform only
        names = set(zipfile.ZipFile(wheel).namelist())
        t = build.target(target)
        libraries = {n for n in names if n.startswith(kernels + build.PREFIX)}
        assert libraries == {kernels + build.library_name(t, v, digest) for v in t.variants}, libraries
        for source in (*build.SOURCES, *build.HEADERS, "build.py", "__init__.py"):
            assert kernels + source in names  # the digest is computed from them where the wheel is installed
