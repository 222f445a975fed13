"""``ray``: each replica is a Ray actor that owns the replica's vLLM server process.

The actor (:class:`~updater.providers.ray_actor.ReplicaActor`) is named
``<actor_prefix>-<replica id>`` in Ray namespace ``namespace`` and created with the replica's
resource request (:class:`~updater.providers.config.RayPlacement`: CPUs, GPUs, memory, custom
resources; a placement group bundle, preferred node labels (soft node affinity) or a label
selector) and ``max_restarts=0`` / ``max_task_retries=0``: Ray never restarts a replica behind
the updater's back; every fresh process is an actor this provider created and counted.

* ``start``: connect to Ray (``ray.init`` unless this process is already a Ray driver, e.g. a
  Ray job), then adopt the replica's actor if one is alive with its server running (a restarted
  updater, ``detached`` actors), else create one. Creation is two steps, each bounded: placement
  (the actor is constructed on a node within ``placement_timeout_s``, else it is killed and
  :class:`~updater.providers.base.PlacementError` names the request that no node could meet),
  then the server's start (the actor starts it like the local provider; bounded by the spec's
  ``startup_max_s``). Any failure kills the actor: nothing is left running.
* ``restart_fresh``: stop the old actor's server (bounded by ``call_timeout_s``: an actor on a
  lost node does not answer), kill the actor, wait until its name is free, create a new one. With
  soft node affinity the new actor may land on another node (after a node loss, on one that
  still has room); the URL it reports then differs, and the updater moves the replica there.
* ``incarnation``: ``ray-actor:<actor id>/pid:<server pid>@<start>``, read from the actor.
* ``alive``: the actor's answer; False once Ray reports the actor dead; None if it did not
  answer within ``call_timeout_s`` (e.g. its node is unreachable): health checks decide.

Every Ray call that can block (``ray.init``, name look-ups, kills) runs in a thread; actor calls
are awaited as futures under a deadline. One provider per updater; calls for different replicas
may run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Self

import ray
from ray.exceptions import ActorDiedError, RayActorError
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from pool.launcher import ReplicaSpec
from updater.config import ReplicaConfig
from updater.providers.base import (
    Location,
    PlacementError,
    ProviderError,
    ProviderSettings,
    ReplicaProvider,
)
from updater.providers.config import RayConfig, RayPlacement
from updater.providers.ray_actor import ReplicaActor

__all__ = ["RayProvider"]

log = logging.getLogger(__name__)
_RemoteActor = ray.remote(ReplicaActor)


async def _call(ref: Any, timeout_s: float) -> Any:
    """Await an actor call's ObjectRef for at most ``timeout_s`` (TimeoutError past it)."""
    async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can lose a cancellation
        return await asyncio.wrap_future(ref.future())


class RayProvider(ReplicaProvider):
    """One Ray actor per replica (see the module docstring)."""

    name = "ray"
    launches = True
    can_restart = True
    adopts = True

    def __init__(self, config: RayConfig, replicas: list[ReplicaConfig]) -> None:
        self.config = config
        self._replicas: dict[str, tuple[ReplicaSpec, RayPlacement]] = {}
        for r in replicas:
            if r.launch is None:
                raise ValueError(f"replica {r.id}: the ray provider needs a launch spec")
            self._replicas[r.id] = (r.launch, r.ray or config.placement)
        self._actors: dict[str, Any] = {}
        self._locations: dict[str, Location] = {}
        self._connected_here = False
        self._connecting = asyncio.Lock()  # starts of several replicas connect once

    @classmethod
    def from_settings(cls, settings: ProviderSettings) -> Self:
        return cls(settings.ray, settings.replicas)

    def actor_name(self, replica_id: str) -> str:
        return f"{self.config.actor_prefix}-{replica_id}"

    def url(self, replica_id: str) -> str | None:
        loc = self._locations.get(replica_id)
        return loc.url if loc is not None else None

    # ------------------------------------------------------------------ connection

    async def _connect(self) -> None:
        async with self._connecting:
            if ray.is_initialized():
                return
            address = self.config.address or os.environ.get("RAY_ADDRESS") or "auto"
            await asyncio.to_thread(
                ray.init,
                address=address,
                namespace=self.config.namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            self._connected_here = True

    async def close(self) -> None:
        """Disconnect from Ray if this provider connected (a Ray job's driver stays connected);
        the actors are left as they are."""
        if self._connected_here and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)
        self._connected_here = False

    def _lookup(self, replica_id: str) -> Any | None:
        try:
            return ray.get_actor(self.actor_name(replica_id), namespace=self.config.namespace)
        except ValueError:
            return None

    # ------------------------------------------------------------------ placement

    def _strategy(self, replica_id: str, p: RayPlacement) -> dict[str, Any]:
        """The actor options that decide where it runs (runs in a thread: reads the nodes)."""
        if p.placement_group is not None:
            try:
                pg = ray.util.get_placement_group(p.placement_group)
            except ValueError as e:
                raise PlacementError(
                    f"replica {replica_id}: no placement group named {p.placement_group!r}",
                    replica=replica_id,
                    provider=self.name,
                ) from e
            return {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=p.bundle_index
                )
            }
        if p.label_selector:
            return {"label_selector": dict(p.label_selector)}
        if p.prefer_node_labels:
            for node in ray.nodes():
                labels = node.get("Labels") or {}
                if node.get("Alive") and all(
                    labels.get(k) == v for k, v in p.prefer_node_labels.items()
                ):
                    strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=True)
                    return {"scheduling_strategy": strategy}
        return {}

    def _options(self, replica_id: str, p: RayPlacement) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "name": self.actor_name(replica_id),
            "namespace": self.config.namespace,
            "max_restarts": 0,
            "max_task_retries": 0,
            "max_concurrency": 8,
            "num_cpus": p.num_cpus,
            "num_gpus": p.num_gpus,
            "resources": dict(p.resources),
        }
        if self.config.detached:
            opts["lifetime"] = "detached"
        if p.memory_bytes is not None:
            opts["memory"] = p.memory_bytes
        if self.config.runtime_env:
            opts["runtime_env"] = dict(self.config.runtime_env)
        opts.update(self._strategy(replica_id, p))
        return opts

    def _request(self, p: RayPlacement) -> str:
        want = {"CPU": p.num_cpus, "GPU": p.num_gpus, **p.resources}
        asked = ", ".join(f"{k}={v:g}" for k, v in want.items() if v)
        where = (
            f" in placement group {p.placement_group!r}"
            if p.placement_group
            else f" with labels {p.label_selector}"
            if p.label_selector
            else ""
        )
        return f"{{{asked}}}{where}"

    async def _launch(self, replica_id: str) -> Location:
        """Create the replica's actor, wait until it is placed, start its server."""
        spec, placement = self._replicas[replica_id]
        opts = await asyncio.to_thread(self._options, replica_id, placement)
        actor = _RemoteActor.options(**opts).remote(
            replica_id, spec.model_dump(mode="json"), self.config.cpu_bind_env
        )
        self._actors[replica_id] = actor
        try:
            await _call(actor.ready.remote(), self.config.placement_timeout_s)
        except TimeoutError:
            await self._kill(replica_id, actor)
            free = await asyncio.to_thread(ray.available_resources)
            raise PlacementError(
                f"replica {replica_id}: no Ray node could host its actor within "
                f"{self.config.placement_timeout_s:g} s (it asks for "
                f"{self._request(placement)}; available now: "
                f"{ {k: round(v, 2) for k, v in sorted(free.items()) if 'node:' not in k} })",
                replica=replica_id,
                provider=self.name,
            ) from None
        except RayActorError as e:
            await self._kill(replica_id, actor)
            raise ProviderError(
                f"replica {replica_id}: its Ray actor died while being created: {e}",
                replica=replica_id,
                provider=self.name,
            ) from e
        try:
            info = await _call(actor.start.remote(), spec.startup_max_s + 60)
        except (TimeoutError, RayActorError) as e:
            info = {"error": f"{type(e).__name__}: {e}"}
        if "error" in info:
            await self._kill(replica_id, actor)
            raise ProviderError(
                f"replica {replica_id}: its server did not start on Ray node "
                f"{info.get('node_address', '?')}: {info['error']}",
                replica=replica_id,
                provider=self.name,
            )
        return self._located(replica_id, info)

    def _located(self, replica_id: str, info: dict[str, Any]) -> Location:
        loc = Location(str(info["url"]), str(info["node_address"]), str(info["node_id"]))
        self._locations[replica_id] = loc
        return loc

    async def _kill(self, replica_id: str, actor: Any) -> None:
        """Stop the actor's server (if it answers in time), kill the actor, and wait until its
        name is free for a successor."""
        try:
            await _call(actor.stop.remote(), self.config.call_timeout_s)
        except (TimeoutError, RayActorError):
            pass  # dead or unreachable: its leash (or its node's end) takes the server down
        await asyncio.to_thread(ray.kill, actor, no_restart=True)
        if self._actors.get(replica_id) is actor:
            del self._actors[replica_id]
        deadline = time.monotonic() + self.config.placement_timeout_s
        while await asyncio.to_thread(self._lookup, replica_id) is not None:
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"replica {replica_id}: Ray still knows actor {self.actor_name(replica_id)} "
                    f"{self.config.placement_timeout_s:g} s after it was killed",
                    replica=replica_id,
                    provider=self.name,
                )
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ the port

    async def start(self, replica_id: str) -> Location:
        await self._connect()
        actor = await asyncio.to_thread(self._lookup, replica_id)
        if actor is not None:
            try:
                info = await _call(actor.identity.remote(), self.config.call_timeout_s)
            except (TimeoutError, RayActorError):
                info = {"alive": False}
            if info.get("alive"):
                self._actors[replica_id] = actor
                log.info("replica %s: adopted Ray actor %s", replica_id, info["actor_id"])
                return self._located(replica_id, info)
            await self._kill(replica_id, actor)  # its server is gone: never reuse it
        return await self._launch(replica_id)

    async def stop(self, replica_id: str) -> None:
        await self._connect()
        actor = self._actors.get(replica_id) or await asyncio.to_thread(self._lookup, replica_id)
        if actor is not None:
            await self._kill(replica_id, actor)
        self._locations.pop(replica_id, None)

    async def restart_fresh(self, replica_id: str) -> Location:
        await self._connect()
        old = self._actors.get(replica_id) or await asyncio.to_thread(self._lookup, replica_id)
        if old is not None:
            await self._kill(replica_id, old)
        return await self._launch(replica_id)

    async def locate(self, replica_id: str) -> Location:
        return self._located(replica_id, await self._identity(replica_id))

    async def incarnation(self, replica_id: str) -> str | None:
        try:
            info = await self._identity(replica_id)
        except ProviderError:
            return None
        return f"ray-actor:{info['actor_id']}/pid:{info['pid']}@{info['pid_start']}"

    async def alive(self, replica_id: str) -> bool | None:
        actor = self._actors.get(replica_id)
        if actor is None:
            return False
        try:
            return bool(await _call(actor.alive.remote(), self.config.call_timeout_s))
        except ActorDiedError:
            return False
        except (TimeoutError, RayActorError):  # unreachable for now (ActorUnavailableError, ...)
            return None

    async def _identity(self, replica_id: str) -> dict[str, Any]:
        actor = self._actors.get(replica_id)
        if actor is None:
            raise ProviderError(
                f"replica {replica_id} has no Ray actor", replica=replica_id, provider=self.name
            )
        try:
            info: dict[str, Any] = await _call(actor.identity.remote(), self.config.call_timeout_s)
        except (TimeoutError, RayActorError) as e:
            raise ProviderError(
                f"replica {replica_id}: its Ray actor does not answer: {type(e).__name__}",
                replica=replica_id,
                provider=self.name,
            ) from e
        return info
