"""The header's start-up progress: the engine's loading phase in words and a bar, shown only while it starts.

The phase comes from the engine's GET /health (engine/contract.py HealthBody): a bar with the percentage where
the engine can tell (loading weights, layer by layer), a busy bar where it cannot (reading the model file).
The widget keeps its size whether shown or not while the engine runs, so the header never jumps when loading
ends; a stopped or failed engine gives its room to the state's words ("Not started: port 8080 is in use").
"""

from __future__ import annotations

from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QSizePolicy, QWidget

from desktop.engine_process import EngineState
from engine.contract import HealthBody

BAR_STEPS = 1000


def describe(health: HealthBody | None) -> str:
    """'loading weights · 45% · 3 s' ('starting…' before the engine answers, 'ready' once it serves)."""
    if health is None:
        return "starting…"
    if health.status != "loading":
        return health.phase
    parts = [health.phase]
    if health.progress is not None:
        parts.append(f"{health.progress:.0%}")
    parts.append(f"{health.elapsed_s:.0f} s")
    return " · ".join(parts)


class StartupView(QWidget):
    """A label and a bar for the start-up phase; hidden (its room kept while the engine runs) unless the engine
    is starting."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("startupProgress")
        self.phase = QLabel()
        self.phase.setObjectName("startupPhase")
        self.phase.setStyleSheet("color: #555;")
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setFixedWidth(140)
        self.bar.setMaximumHeight(14)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.phase)
        layout.addWidget(self.bar)
        policy = self.sizePolicy()
        policy.setRetainSizeWhenHidden(True)
        policy.setHorizontalPolicy(QSizePolicy.Policy.Preferred)
        self.setSizePolicy(policy)
        self.health: HealthBody | None = None
        self.state = EngineState.STOPPED
        self.hide()

    def set_state(self, state: EngineState) -> None:
        self.state = state
        self._show()

    def set_health(self, health: HealthBody | None) -> None:
        self.health = health
        self._show()

    def _show(self) -> None:
        starting = self.state in (EngineState.STARTING, EngineState.LOADING)
        policy = self.sizePolicy()
        keep = self.state not in (EngineState.STOPPED, EngineState.CRASHED)
        if policy.retainSizeWhenHidden() != keep:
            policy.setRetainSizeWhenHidden(keep)
            self.setSizePolicy(policy)
        self.setVisible(starting)
        if not starting:
            return
        self.phase.setText(describe(self.health))
        health = self.health if self.health is not None and self.health.status == "loading" else None
        if health is not None and health.progress is not None:
            self.bar.setRange(0, BAR_STEPS)
            self.bar.setValue(round(min(max(health.progress, 0.0), 1.0) * BAR_STEPS))
        else:
            self.bar.setRange(0, 0)  # busy: the phase cannot say how far it is
        self.bar.setToolTip(self.phase.text())
