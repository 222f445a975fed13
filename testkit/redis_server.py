"""A local ``redis-server`` for tests and benchmarks: the embedded pool's launcher
(:class:`rolloutpool.local.redis.RedisServer`), with its port helper."""

from rolloutpool.local.redis import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]
