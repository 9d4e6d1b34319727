"""The remote conversation-cache store's URL (--conversation-cache-remote): parsed once, shown only redacted.

`redis://[user[:password]@]host[:port][/db]`, or `rediss://` for TLS (Valkey answers the same URLs). The
password is never part of what logs, GET /cache/config or /metrics show (`redacted`). A host that is not this
machine is refused unless the network is allowed explicitly: parked K/V is the conversation itself in another
form, so sending it over a network is a decision, not a default. Standard library only (the desktop imports it).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

SCHEMES = ("redis", "rediss")
DEFAULT_PORT = 6379
EXPECTED = "redis://[user:password@]host[:port][/db] or rediss://… (TLS)"


@dataclass(frozen=True, slots=True)
class StoreURL:
    scheme: str
    host: str
    port: int
    db: int
    username: str = ""
    password: str = ""

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    @property
    def loopback(self) -> bool:
        """The host is this machine by its literal name or address (no DNS look-up: a name could change)."""
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def redacted(self) -> str:
        """The URL with its password replaced by `***`: what may be shown anywhere."""
        user = quote(self.username, safe="")
        cred = f"{user}:***@" if self.password else (f"{user}@" if user else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{cred}{host}:{self.port}/{self.db}"


def parse_store_url(raw: str) -> StoreURL:
    """Parse a store URL; ValueError saying what was wrong (the password never appears in it)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"expected {EXPECTED}, got an empty value")
    try:
        parts = urlsplit(raw.strip())
        port = parts.port
    except ValueError as exc:  # a port that is not a number, or out of range
        raise ValueError(f"expected {EXPECTED}, got a bad port ({exc})") from None
    shown = redact_url(raw)
    if parts.scheme not in SCHEMES:
        raise ValueError(f'expected {EXPECTED}, got "{shown}" (scheme "{parts.scheme}")')
    if not parts.hostname:
        raise ValueError(f'expected {EXPECTED}, got "{shown}" (no host)')
    if parts.query or parts.fragment:
        raise ValueError(f'expected {EXPECTED} without ?options or #fragment, got "{shown}"')
    path = parts.path.strip("/")
    if path and not (path.isdigit() and int(path) < 1 << 16):
        raise ValueError(f'expected {EXPECTED} with a database number after the /, got "{shown}"')
    return StoreURL(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port or DEFAULT_PORT,
        db=int(path or 0),
        username=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
    )


def redact_url(raw: str) -> str:
    """`raw` with any password replaced by `***`, also when the rest does not parse (for error messages)."""
    scheme, sep, rest = raw.partition("://")
    if not sep:
        return raw
    netloc, slash, tail = rest.partition("/")
    cred, at, host = netloc.rpartition("@")
    if at and ":" in cred:
        netloc = f"{cred.split(':', 1)[0]}:***@{host}"
    return f"{scheme}://{netloc}{slash}{tail}"
