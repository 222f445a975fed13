"""How to reach Redis: ``StoreSettings`` for standalone, Sentinel and Cluster, and where the
embedded pool's (``rolloutpool up --config``) Redis comes from."""

from __future__ import annotations

import pytest
import yaml

from pool.settings import StoreSettings
from rolloutpool.embedded import PoolConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("ROLLOUTPOOL_"):
            monkeypatch.delenv(key)


def test_default_starts_its_own_redis() -> None:
    c = PoolConfig()
    assert c.embedded_redis
    s = c.store_settings("redis://127.0.0.1:7000/0")
    assert s.mode == "standalone" and s.url == "redis://127.0.0.1:7000/0"


def test_sentinels_from_the_yaml_config() -> None:
    c = PoolConfig(
        **yaml.safe_load(
            """
            namespace: pool1
            redis:
              sentinels: [10.0.0.1:26379, 10.0.0.2:26379, 10.0.0.3:26379]
              sentinel_service: rolloutpool
              sentinel_password: s3cret-pass
              wait_replicas: 1
            """
        )
    )
    assert not c.embedded_redis
    s = c.store_settings()
    assert s.mode == "sentinel" and s.namespace == "pool1" and s.wait_replicas == 1
    assert s.sentinel_addresses()[2] == ("10.0.0.3", 26379)
    assert "s3cret" not in s.safe_url


def test_cluster_and_a_url_skip_the_embedded_server() -> None:
    c = PoolConfig(redis_url="redis://10.0.0.9:6379/0", redis={"cluster": True})
    assert not c.embedded_redis and c.store_settings().mode == "cluster"
    with pytest.raises(ValueError, match="either sentinels or cluster"):
        PoolConfig(redis={"cluster": True, "sentinels": ["h:1"]}).store_settings()


def test_sentinels_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTPOOL_REDIS_SENTINELS", "s1:26379, s2:26379,s3:26380")
    monkeypatch.setenv("ROLLOUTPOOL_REDIS_SENTINEL_SERVICE", "pool-a")
    monkeypatch.setenv("ROLLOUTPOOL_REDIS_URL", "redis://ignored:1/3")
    s = StoreSettings()
    assert s.mode == "sentinel" and s.sentinels == ["s1:26379", "s2:26379", "s3:26380"]
    assert s.safe_url == "sentinel://s1:26379,s2:26379,s3:26380/pool-a"
    monkeypatch.setenv("ROLLOUTPOOL_REDIS_SENTINELS", '["s1:26379"]')
    assert StoreSettings().sentinels == ["s1:26379"]


@pytest.mark.parametrize("bad", ["s1", "s1:", ":26379", "s1:0", "s1:99999", "s1:abc"])
def test_a_malformed_sentinel_address_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not host:port"):
        StoreSettings(sentinels=[bad])


def test_placeholder_sentinel_password_is_refused() -> None:
    with pytest.raises(ValueError, match="placeholder"):
        StoreSettings(sentinels=["s:1"], sentinel_password="CHANGE-ME")
