"""--conversation-cache-remote: what URL is accepted, what is refused and why, and that no password is shown."""

from __future__ import annotations

import pytest

from engine.cli import parse_config
from engine.config import EngineConfig
from engine.setting import SettingError
from engine.store_url import parse_store_url


def test_url_parts_defaults_and_redaction():
    url = parse_store_url("rediss://cache:s%3Acret@[::1]:6380/2")
    assert (url.tls, url.host, url.port, url.db, url.username, url.password) == (True, "::1", 6380, 2, "cache", "s:cret")
    assert url.loopback and url.redacted() == "rediss://cache:***@[::1]:6380/2"
    plain = parse_store_url("redis://localhost")
    assert (plain.port, plain.db, plain.loopback, plain.redacted()) == (6379, 0, True, "redis://localhost:6379/0")


@pytest.mark.parametrize(("raw", "why"), [
    ("http://127.0.0.1:6379", 'scheme "http"'), ("redis://", "no host"), ("redis://127.0.0.1:99999", "bad port"),
    ("redis://127.0.0.1/abc", "database number"), ("redis://127.0.0.1/0?ssl=1", "without ?options"),
    ("127.0.0.1:6379", "scheme"),
])
def test_bad_urls_are_refused_saying_what_is_expected(raw, why):
    with pytest.raises(SettingError, match="--conversation-cache-remote: expected redis://") as exc:
        parse_config(["--conversation-cache-remote", raw])
    assert why in str(exc.value)


def test_a_host_on_the_network_needs_the_allow_flag_and_the_password_never_shows():
    raw = "redis://ops:hunter2@10.1.2.3:6379/0"
    with pytest.raises(SettingError) as exc:
        parse_config(["--conversation-cache-remote", raw])
    assert "--conversation-cache-remote-allow-network" in str(exc.value) and "hunter2" not in str(exc.value)
    with pytest.raises(SettingError) as exc:
        parse_config(["--conversation-cache-remote", "ftp://ops:hunter2@10.1.2.3"])
    assert "hunter2" not in str(exc.value)
    config = parse_config(["--conversation-cache-remote", raw, "--conversation-cache-remote-allow-network"])
    assert config.public_dict()["conversation_cache_remote"] == "redis://ops:***@10.1.2.3:6379/0"
    assert "hunter2" not in repr(EngineConfig().replace(conversation_cache_remote="redis://:hunter2@127.0.0.1")
                                 .public_dict())


def test_a_store_needs_a_local_cache_in_front_of_it():
    with pytest.raises(SettingError, match="--conversation-cache-remote: expected a conversation cache"):
        parse_config(["--conversation-cache-remote", "redis://127.0.0.1", "--conversation-cache-mib", "0"])
    config = parse_config(["--conversation-cache-remote", "redis://127.0.0.1", "--conversation-cache-mib", "0",
                           "--conversation-cache-storage", "disk"])
    assert config.conversation_cache_remote == "redis://127.0.0.1"
