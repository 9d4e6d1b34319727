"""Fixtures every test module may ask for by name."""

from tests.int4_kernels import kernel  # noqa: F401 (the 4-bit kernels in turn)
