"""What a pool on one machine runs besides its replicas and services: a local ``redis-server``
(:mod:`rolloutpool.local.redis`)."""
