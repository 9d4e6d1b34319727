"""The package's build step beyond pyproject.toml: the native CPU kernels (engine/model/kernels) compiled into the
package, so that an installed engine runs the same kernels whether or not its machine has a C compiler.

A plain setuptools command rather than another build backend: the libraries are not Python extension modules (no
Python ABI, loaded with ctypes, three builds of one source, one of them cross-compiled for Windows), which
setuptools' Extension machinery, setuptools-dso and scikit-build-core (CMake) each would have to be bent into, and
every one of them is another build dependency in the lock. engine/model/kernels/build.py knows the compilers and
flags; the engine's first-use compile uses the same file.

- A wheel (`pip wheel .`) holds the libraries for its platform and is tagged py3-none-<platform> (they do not
  use Python's ABI). STRATA_KERNELS_TARGET=windows-x86_64 (or linux-aarch64) cross-builds one for that platform
  with its cross compiler; a library already built for the current sources in engine/model/kernels is copied
  rather than compiled again.
- An editable install (`pip install -e . --no-build-isolation`, scripts/setup.sh) builds them beside the sources,
  skipping those already built for the current sources; where no compiler is found it says so and installs
  anyway: the engine then compiles on first use, or runs PyTorch's kernel.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import Command, Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join("engine", "model", "kernels")
TARGET_ENV = "STRATA_KERNELS_TARGET"
WHEEL_PLATFORMS = {"linux-x86_64": "linux_x86_64", "linux-aarch64": "linux_aarch64", "windows-x86_64": "win_amd64"}


def kernel_build():
    """engine/model/kernels/build.py, loaded by path: importing the engine package would import torch."""
    spec = importlib.util.spec_from_file_location("strata_kernel_build", os.path.join(ROOT, KERNELS, "build.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def target_name() -> str:
    return os.environ.get(TARGET_ENV) or kernel_build().host_name()


class build_kernels(Command):
    """Compiles the native kernels' libraries into the package (module docstring)."""

    description = "compile the native CPU kernels (engine/model/kernels) for the package"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self.outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        kb = kernel_build()
        t = kb.target(target_name())
        source = os.path.join(ROOT, KERNELS)
        out = source if self.editable_mode else os.path.join(self.build_lib, KERNELS)
        if not self.editable_mode and os.path.isdir(out):  # another target's libraries from an earlier build
            for name in os.listdir(out):
                if name.startswith(kb.PREFIX) and not name.startswith(f"{kb.PREFIX}-{t.name}-"):
                    os.unlink(os.path.join(out, name))
        try:
            self.outputs = kb.build(t, out, reuse=source, log=print)
        except kb.BuildError as e:
            if not self.editable_mode:
                raise SystemExit(f"build_kernels: {e}") from e
            print(f"build_kernels: {e}; the engine will compile them on first use where it finds a compiler, "
                  f"else run PyTorch's kernel", file=sys.stderr)

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else self.outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class build_with_kernels(build):
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class PlatformDistribution(Distribution):
    """Platform-specific contents (the libraries) without extension modules: built into the platform's build folder
    and installed as platform files, as an extension's would be."""

    def has_ext_modules(self) -> bool:
        return True


class platform_wheel(bdist_wheel):
    """A wheel for one platform (the libraries) and any Python 3 (they do not use its ABI)."""

    def finalize_options(self) -> None:
        name = target_name()
        if name != kernel_build().host_name() and not self.plat_name:
            self.plat_name = WHEEL_PLATFORMS[name]
        super().finalize_options()

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


setup(distclass=PlatformDistribution,
      cmdclass={"build": build_with_kernels, "build_kernels": build_kernels, "bdist_wheel": platform_wheel})
