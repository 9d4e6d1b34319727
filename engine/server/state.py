"""What the routes share: the config, the engine once loaded, and how to stop the process."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from engine.config import EngineConfig
from engine.errors import ApiError
from engine.server.prompt_tokens import PromptIds
from engine.server.response_store import ResponseStore
from engine.startup_progress import StartupProgress

if TYPE_CHECKING:
    from engine.runtime.engine import Engine


@dataclass
class ServerState:
    """`engine` is None while the model loads: /health answers 503 "loading" with the start-up phase from
    `progress`, and every other route 503."""

    config: EngineConfig
    engine: Engine | None = None
    shutdown: Callable[[], None] | None = None  # set by the CLI; POST /shutdown calls it
    started: int = field(default_factory=lambda: int(time.time()))
    progress: StartupProgress = field(default_factory=StartupProgress)  # the loader moves it on
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored responses
    prompt_ids: PromptIds = field(init=False)  # how prompts become ids: answers as generated, text as text

    def __post_init__(self) -> None:
        self.prompt_ids = PromptIds(contents_as_text=not self.config.allow_special_in_content)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def require_engine(request: Request) -> Engine:
    """The loaded engine, or a 503 while the model is still loading."""
    engine = server_state(request).engine
    if engine is None:
        raise ApiError(503, "the model is still loading; retry when GET /health reports ok")
    return engine
