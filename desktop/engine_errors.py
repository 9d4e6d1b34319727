"""What a failed engine start means, in words a user acts on.

The engine ends a start it refuses (a bad flag, a model it cannot load, a port it cannot listen on, a cache
folder it cannot use) with exit status 2 and one line `strata serve: error: <reason>` on stderr (engine/cli.py).
Such a failure repeats on every retry, so it is never restarted automatically; anything else is a crash.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from engine.config import all_settings

CONFIG_EXIT_STATUS = 2
ERROR_LINE = re.compile(r"^strata serve: error: (?P<reason>.+?)\s*$")
CANNOT_LISTEN = re.compile(r"cannot listen on (?P<host>.+):(?P<port>\d+): (?P<why>.+)$")
# strerror of EADDRINUSE: "Address already in use" (Linux, macOS); WSAEADDRINUSE on Windows.
IN_USE = re.compile(r"in use|only one usage of each socket address", re.IGNORECASE)


def config_error(exit_code: int | None, signalled: bool, lines: Iterable[str]) -> str | None:
    """The engine's reason when it refused its configuration (status 2 and its error line), else None."""
    if signalled or exit_code != CONFIG_EXIT_STATUS:
        return None
    reason = None
    for line in lines:
        m = ERROR_LINE.match(line)
        if m:
            reason = m.group("reason")  # the last one wins: the engine prints one
    return reason


@dataclass(frozen=True, slots=True)
class BusyPort:
    host: str
    port: int


def busy_port(reason: str) -> BusyPort | None:
    """The address when `reason` says the port is taken by another program."""
    m = CANNOT_LISTEN.search(reason)
    if m is None or not IN_USE.search(m.group("why")):
        return None
    return BusyPort(m.group("host"), int(m.group("port")))


@dataclass(frozen=True, slots=True)
class PortOwner:
    name: str | None
    pid: int | None
    unknown_why: str = ""  # why the owner could not be found, when it could not


def port_owner(port: int) -> PortOwner:
    """The program listening on TCP `port`. Blocking (reads the process table): run off the GUI thread."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return PortOwner(None, None, "listing connections needs administrator rights here")
    pids = {c.pid for c in conns if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    pids.discard(None)
    if not pids:
        # Listed without a pid: the socket belongs to another user's process.
        return PortOwner(None, None, "it belongs to another user or the system")
    pid = min(pids)
    try:
        return PortOwner(psutil.Process(pid).name(), pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return PortOwner(None, pid)


def describe_busy_port(busy: BusyPort, owner: PortOwner | None) -> str:
    """'Port 8080 is in use by nginx (pid 812): choose another port in Settings.'"""
    if owner is None:
        by = "another program"
    elif owner.name and owner.pid is not None:
        by = f"{owner.name} (pid {owner.pid})"
    elif owner.pid is not None:
        by = f"another program (pid {owner.pid})"
    else:
        by = "another program (which one is unknown: " + (owner.unknown_why or "not found") + ")"
    return f"Port {busy.port} is in use by {by}: choose another port in Settings."


def describe_config_error(reason: str) -> str:
    """A plain sentence for an engine's refusal other than a busy port; the engine's own words follow it."""
    if reason.startswith("cannot load the model"):
        head = "The engine could not load the model"
        detail = reason.removeprefix("cannot load the model").lstrip(": ")
    elif reason.startswith("conversation cache"):
        head = "The engine could not set up the conversation cache"
        detail = reason.removeprefix("conversation cache").lstrip(": ")
    elif reason.startswith("--host/--port"):
        head = "The engine could not listen on the address in Settings"
        detail = reason.split(": ", 1)[1] if ": " in reason else reason
    else:
        head = "The engine refused a setting"
        detail = reason
    return f"{head}: {detail}. Change it in Settings and start the engine again."


def refused_words(reason: str) -> str:
    """A refused start in a few words, for the header and the tray: "port 8080 is in use"."""
    busy = busy_port(reason)
    if busy:
        return f"port {busy.port} is in use"
    if reason.startswith("cannot load the model"):
        return "the model could not be loaded"
    if reason.startswith("conversation cache"):
        return "the conversation cache could not be set up"
    if reason.startswith("--host/--port"):
        return "the address could not be used"
    return "a setting was refused"


def setting_for_error(reason: str) -> str:
    """The setting a refused start points at: the one to open in Settings."""
    if busy_port(reason) or reason.startswith("--host/--port"):
        return "port"
    if reason.startswith("conversation cache"):
        return "conversation_cache_dir"
    m = re.match(r"(--[a-z0-9-]+):", reason)
    if m:
        for name, spec, _ in all_settings():
            if spec.flag == m.group(1):
                return name
    return "model"
