"""Prometheus metrics shared by router and updater (names are part of the public contract:
``deploy/grafana`` dashboards and alerts refer to them).

Each component builds its own set on its own :class:`~prometheus_client.CollectorRegistry` (tests
build many apps in one process). Label values are replica ids, states and reasons — never
secrets, tokens or prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pool.types import ReplicaRecord, ReplicaState

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class PoolGauges:
    """Per-replica state as seen in the store, and Redis itself (reachable, memory used and its
    limit: ``deploy/prometheus/alerts.yml`` alerts on them); refreshed from :meth:`observe` and
    :meth:`observe_redis` before a scrape."""

    replica_generation: Gauge
    replica_state: Gauge
    replica_active: Gauge
    published_generation: Gauge
    redis_up: Gauge
    redis_used_memory: Gauge
    redis_maxmemory: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> PoolGauges:
        return cls(
            replica_generation=Gauge(
                "rolloutpool_replica_generation",
                "Generation number a replica serves (-1 before bootstrap)",
                ["replica"],
                registry=registry,
            ),
            replica_state=Gauge(
                "rolloutpool_replica_state",
                "1 for the replica's current lifecycle state, 0 otherwise",
                ["replica", "state"],
                registry=registry,
            ),
            replica_active=Gauge(
                "rolloutpool_active_bindings",
                "Active rollout bindings per replica",
                ["replica"],
                registry=registry,
            ),
            published_generation=Gauge(
                "rolloutpool_published_generation",
                "The latest published (committed) generation number",
                registry=registry,
            ),
            redis_up=Gauge(
                "rolloutpool_redis_up",
                "1 if Redis answered this process at the last scrape, else 0",
                registry=registry,
            ),
            redis_used_memory=Gauge(
                "rolloutpool_redis_used_memory_bytes",
                "Redis used_memory (INFO memory) at the last scrape that reached it",
                registry=registry,
            ),
            redis_maxmemory=Gauge(
                "rolloutpool_redis_maxmemory_bytes",
                "Redis maxmemory (0: no limit) at the last scrape that reached it",
                registry=registry,
            ),
        )

    def observe(self, replicas: list[ReplicaRecord], published: int | None) -> None:
        for r in replicas:
            self.replica_generation.labels(r.replica_id).set(
                -1 if r.generation is None else r.generation
            )
            for s in ReplicaState:
                self.replica_state.labels(r.replica_id, s.value).set(int(r.state is s))
            self.replica_active.labels(r.replica_id).set(r.active)
        self.published_generation.set(-1 if published is None else published)

    def observe_redis(self, used: int, maximum: int) -> None:
        self.redis_used_memory.set(used)
        self.redis_maxmemory.set(maximum)


@dataclass
class RouterMetrics:
    admissions: Counter
    refusals: Counter
    rollouts_ended: Counter
    violations: Counter
    request_latency: Histogram
    admission_latency: Histogram
    pool: PoolGauges
    path_round_trips: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RouterMetrics:
        return cls(
            admissions=Counter(
                "rolloutpool_admissions",
                "Rollouts admitted, by replica",
                ["replica"],
                registry=registry,
            ),
            refusals=Counter(
                "rolloutpool_admission_refusals",
                "Requests refused admission, by reason",
                ["reason"],
                registry=registry,
            ),
            rollouts_ended=Counter(
                "rolloutpool_rollouts_ended",
                "Rollouts released, by final state (finished/aborted/violated)",
                ["state"],
                registry=registry,
            ),
            violations=Counter(
                "rolloutpool_violations",
                "Rollouts whose weight_versions spans contradicted their binding",
                ["replica"],
                registry=registry,
            ),
            request_latency=Histogram(
                "rolloutpool_request_seconds",
                "End-to-end router request latency, by route",
                ["route"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            admission_latency=Histogram(
                "rolloutpool_admission_seconds",
                "Time from request arrival to admission (includes queueing for a replica)",
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            pool=PoolGauges.create(registry),
            path_round_trips=Counter(
                "rolloutpool_router_path_round_trips",
                "Redis round trips one-request rollouts waited for before their answer, by "
                "call (admit, release: without grants; grant: a grant grown because no slot "
                "was free)",
                ["call"],
                registry=registry,
            ),
        )


@dataclass
class UpdaterMetrics:
    updates: Counter
    phase_seconds: Histogram
    staleness_window: Histogram
    taints: Counter
    recoveries: Counter
    restarts: Counter
    pool: PoolGauges

    @classmethod
    def create(cls, registry: CollectorRegistry) -> UpdaterMetrics:
        return cls(
            updates=Counter(
                "rolloutpool_updates",
                "Rolling updates, by result (succeeded/failed)",
                ["result"],
                registry=registry,
            ),
            phase_seconds=Histogram(
                "rolloutpool_update_phase_seconds",
                "Duration of each per-replica update phase",
                ["phase"],
                buckets=PHASE_BUCKETS,
                registry=registry,
            ),
            staleness_window=Histogram(
                "rolloutpool_update_staleness_window_seconds",
                "Push to every replica in service on the new generation (an update's roll)",
                buckets=PHASE_BUCKETS,
                registry=registry,
            ),
            taints=Counter(
                "rolloutpool_taints",
                "Replicas moved to TAINTED, by replica",
                ["replica"],
                registry=registry,
            ),
            recoveries=Counter(
                "rolloutpool_recoveries",
                "Replica recoveries, by result (succeeded/failed)",
                ["result"],
                registry=registry,
            ),
            restarts=Counter(
                "rolloutpool_replica_restarts",
                "Fresh processes the replica provider started for a replica, by replica",
                ["replica", "provider"],
                registry=registry,
            ),
            pool=PoolGauges.create(registry),
        )
