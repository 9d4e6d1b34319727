"""The tray icon shows the engine's state at a glance: a badge in the state's colour, drawn on the app icon."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

import signal

import pytest
from PySide6.QtGui import QColor

from desktop.engine_process import EngineState
from desktop.main_window import app_icon
from desktop.tray import BADGE_SHARE, STATE_COLORS, Tray
from tests.test_desktop_support import stand_in_window, wait_ready

pytestmark = pytest.mark.timeout(90)
SIZE = 32


def badge_color(tray: Tray) -> QColor:
    """The colour at the middle of the badge of the icon the tray shows now."""
    image = tray.icon.icon().pixmap(SIZE, SIZE).toImage()
    centre = int(SIZE - SIZE * BADGE_SHARE / 2) - 1
    return image.pixelColor(centre, centre)


def test_each_state_has_its_own_badge(qtbot):
    tray = Tray(app_icon())
    assert badge_color(tray).name() == STATE_COLORS[EngineState.STOPPED]
    seen = {}
    for state in (EngineState.STARTING, EngineState.READY, EngineState.CRASHED, EngineState.STOPPED):
        tray.update_status(state, None, None)
        assert badge_color(tray).name() == STATE_COLORS[state], state
        seen[state] = tray.icon.icon().pixmap(SIZE, SIZE).toImage()
    assert len({img.cacheKey() for img in seen.values()}) == 4
    corner = tray.icon.icon().pixmap(SIZE, SIZE).toImage().pixelColor(2, 2)
    assert corner.name() != STATE_COLORS[EngineState.STOPPED], "the app icon stays visible around the badge"


@pytest.fixture
def window(qtbot, tmp_path):
    yield from stand_in_window(qtbot, tmp_path)


def test_the_window_keeps_the_tray_badge_in_step_with_the_engine(qtbot, window):
    window.engine.auto_restart = False  # the crashed state stays until asked
    window.start()
    wait_ready(qtbot, window)
    assert badge_color(window.tray).name() == STATE_COLORS[EngineState.READY]
    os.kill(window.engine.pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: window.engine.state is EngineState.CRASHED, timeout=10000)
    assert badge_color(window.tray).name() == STATE_COLORS[EngineState.CRASHED]
