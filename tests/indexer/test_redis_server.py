"""The throwaway redis-server the Redis suites run against."""

from __future__ import annotations

from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]


def test_the_server_answers_and_persists_nothing(redis_server: RedisServer) -> None:
    c = redis_server.client()
    try:
        assert c.ping()
        assert c.config_get("save")["save"] == ""
        assert c.config_get("appendonly")["appendonly"] == "no"
        assert redis_server.port < 32768
    finally:
        c.close()
