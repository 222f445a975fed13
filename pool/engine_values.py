"""What a vLLM server offers and answers, as values: the capabilities of its version
(:class:`Capabilities`, from ``GET /version``) and the shapes of the control plane's replies
(:class:`EngineMetrics` from ``/metrics``, :class:`WorldSize`, :class:`AbortResult`,
:class:`RpcResult`, :class:`GenerateResult`). :class:`pool.engine.VllmEngine` returns them (and
:mod:`pool.engine` exports them); they do no I/O and are immutable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "AbortResult",
    "Capabilities",
    "EngineMetrics",
    "RpcResult",
    "WorldSize",
    "parse_version",
]


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; ``"0.11.1rc2.dev35+g1"`` -> ``(0, 11, 1)``.

    Raises ``ValueError`` if the string does not start with ``MAJOR.MINOR``.
    """
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class Capabilities:
    """What the server's vLLM version offers (from ``GET /version``).

    ``labels``: ``/weight_info`` and ``/update_weight_version`` (0.27+).
    ``spans_generate``: per-token ``weight_versions`` on ``/inference/v1/generate`` (0.32+).
    ``spans_completions``: the same on ``/v1/completions`` with ``return_weight_versions``
    (0.33+). ``paused_503``: a new request sent while paused (``abort``/``wait``) gets HTTP 503
    instead of being queued silently (0.33+).
    """

    version: str
    version_tuple: tuple[int, int, int]
    labels: bool
    spans_generate: bool
    spans_completions: bool
    paused_503: bool

    @classmethod
    def from_version(cls, version: str) -> Capabilities:
        v = parse_version(version)
        return cls(
            version=version,
            version_tuple=v,
            labels=v >= (0, 27, 0),
            spans_generate=v >= (0, 32, 0),
            spans_completions=v >= (0, 33, 0),
            paused_503=v >= (0, 33, 0),
        )


@dataclass(frozen=True)
class EngineMetrics:
    """A scrape of ``/metrics``, each value summed over all label sets (engines, models).

    Prefix-cache counters count tokens (queried / served from cache) since server start.
    ``process_start_time`` is the API server process's start (Unix seconds, prometheus_client's
    ``process_start_time_seconds``; None where the server does not export it, e.g. vLLM with
    several API server processes): it tells one server process from its successor.
    """

    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_running: int
    requests_waiting: int
    process_start_time: float | None = None

    @classmethod
    def parse(cls, text: str) -> EngineMetrics:
        """The values of a ``/metrics`` text; ``ValueError`` if it does not parse."""
        started: float | None = None
        wanted = {
            "vllm:prefix_cache_queries_total": 0.0,
            "vllm:prefix_cache_hits_total": 0.0,
            "vllm:num_requests_running": 0.0,
            "vllm:num_requests_waiting": 0.0,
        }
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    wanted[sample.name] += sample.value
                elif sample.name == "process_start_time_seconds":
                    started = sample.value
        return cls(
            prefix_cache_queries=int(wanted["vllm:prefix_cache_queries_total"]),
            prefix_cache_hits=int(wanted["vllm:prefix_cache_hits_total"]),
            requests_running=int(wanted["vllm:num_requests_running"]),
            requests_waiting=int(wanted["vllm:num_requests_waiting"]),
            process_start_time=started,
        )

    @property
    def process(self) -> str | None:
        """The serving process's identity: evidence that a restart happened when it changes."""
        if self.process_start_time is None:
            return None
        return f"api-server-started:{self.process_start_time:.2f}"


@dataclass(frozen=True)
class WorldSize:
    """``GET /get_world_size``: TP*PP (times DP when ``include_dp``)."""

    world_size: int
    include_dp: bool


@dataclass(frozen=True)
class AbortResult:
    """``POST /abort_requests``: ``requested`` is None when everything was aborted."""

    aborted: int
    requested: tuple[str, ...] | None


@dataclass(frozen=True)
class RpcResult:
    """``POST /collective_rpc``: one result per worker (None, a JSON value, or a string)."""

    method: str
    results: tuple[Any, ...]
    elapsed_s: float
