"""Fixtures every test module may ask for by name, and the run's header."""

import os
import shutil
import tempfile

from tests.int4_kernels import kernel  # noqa: F401 (the 4-bit kernels in turn)


def pytest_report_header(config) -> list[str]:
    """The free disk where the run writes (its temporary folders; the agents and model caches under the home
    folder): a whole run needs a few GiB, and a full disk fails tests far from the cause."""
    places = {"temporary folders": tempfile.gettempdir(), "home": os.path.expanduser("~")}
    return ["free disk: " + ", ".join(f"{_free(path)} under {path} ({what})" for what, path in places.items())]


def _free(path: str) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB"
    except OSError as error:  # a HOME that does not exist (HOME=/nonexistent): the run goes on
        return f"unknown ({error.strerror})"
