"""Domain types shared by every part of RolloutPool. Frozen values, no I/O.

* :class:`Generation` answers "which committed weights does this replica serve": a
  monotonically increasing integer plus a human label (``g7``, ``step-700``).
* :class:`WeightIdentity` answers "which declared source were those weights meant to be": the
  digest of the parameter manifest (sorted names, shapes, dtypes) plus provenance. Two
  checkpoints of one architecture share a manifest digest; their identities still differ because
  the provenance (URI, run, step, content hash) goes into :attr:`WeightIdentity.digest`.
* :class:`ReplicaRecord` and :class:`Binding` are what the store keeps in Redis.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

_LABEL_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:+")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Generation(_Frozen):
    """A committed policy generation: ``number`` orders generations, ``label`` names one."""

    number: int = Field(ge=0)
    label: str = Field(min_length=1, max_length=128)

    @field_validator("label")
    @classmethod
    def _label_chars(cls, v: str) -> str:
        bad = set(v) - _LABEL_CHARS
        if bad:
            raise ValueError(f"label may use [A-Za-z0-9-_.:+] only, got {sorted(bad)!r}")
        return v

    @classmethod
    def initial(cls, label: str = "g0") -> Generation:
        return cls(number=0, label=label)

    def next(self, label: str | None = None) -> Generation:
        n = self.number + 1
        return Generation(number=n, label=label or f"g{n}")


#: Bytes per element of each dtype a checkpoint's tensors may have, by torch attribute name.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "complex64": 8,
}


class TensorSpec(_Frozen):
    """One parameter of a checkpoint as it appears in a manifest."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch attribute name: "float32", "bfloat16", ... (sizes: DTYPE_BYTES)


class Manifest(_Frozen):
    """The sorted parameter specs of a model. Equality of digests = same architecture layout."""

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, specs: Iterable[TensorSpec]) -> Manifest:
        return cls(tensors=tuple(sorted(specs, key=lambda s: s.name)))

    @property
    def digest(self) -> str:
        canon = [[t.name, list(t.shape), t.dtype] for t in self.tensors]
        blob = json.dumps(canon, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    def diff(self, other: Manifest, limit: int = 5) -> list[str]:
        """Human-readable differences from ``self`` (expected) to ``other`` (actual)."""
        mine, theirs = self.by_name(), other.by_name()
        out: list[str] = []
        for name in sorted(mine.keys() - theirs.keys()):
            out.append(f"missing tensor {name}")
        for name in sorted(theirs.keys() - mine.keys()):
            out.append(f"unexpected tensor {name}")
        for name in sorted(mine.keys() & theirs.keys()):
            a, b = mine[name], theirs[name]
            if a.shape != b.shape:
                out.append(f"{name}: shape {list(b.shape)} != expected {list(a.shape)}")
            if a.dtype != b.dtype:
                out.append(f"{name}: dtype {b.dtype} != expected {a.dtype}")
        return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


class WeightIdentity(_Frozen):
    """What a set of weights was declared to be. :attr:`digest` is the identity's name."""

    manifest_digest: str
    checkpoint_uri: str
    trainer_run: str = ""
    step: int | None = None
    content_hash: str | None = None

    @property
    def digest(self) -> str:
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return "wid:" + hashlib.sha256(blob.encode()).hexdigest()[:32]


class ReplicaState(StrEnum):
    UNINITIALIZED = "UNINITIALIZED"
    READY = "READY"
    DRAINING = "DRAINING"
    QUIESCED = "QUIESCED"
    UPDATING = "UPDATING"
    INVALIDATING = "INVALIDATING"
    VALIDATING = "VALIDATING"
    RESUMING = "RESUMING"
    TAINTED = "TAINTED"
    RECOVERING = "RECOVERING"


class BindingState(StrEnum):
    ACTIVE = "active"
    FINISHED = "finished"
    ABORTED = "aborted"
    VIOLATED = "violated"


class ReplicaRecord(_Frozen):
    """A replica as the store sees it. ``generation`` is what it serves (None before bootstrap);
    ``process`` is the identity of the server process its last bootstrap proved (see
    :attr:`pool.engine.EngineMetrics.process`). ``active`` counts its active bindings,
    ``granted`` the slots live routers hold on it in advance (:mod:`pool.store.grants`): a
    drain waits for both to be 0. ``grants_aborted``: why routers must cut what runs under
    their grants on it ('' = nothing to abort)."""

    replica_id: str
    url: str
    state: ReplicaState
    generation: int | None = None
    label: str | None = None
    identity_digest: str | None = None
    active: int = 0
    capacity: int = 64
    fence: int = 0
    reason: str = ""
    updated_ms: int = 0
    process: str | None = None
    granted: int = 0
    grants_aborted: str = ""

    @property
    def busy(self) -> int:
        """What a drain waits for: active bindings plus granted slots."""
        return self.active + self.granted


class Binding(_Frozen):
    """One rollout bound to one replica and one generation, from admission to release.

    ``client`` is the identity that may use it ('' = anyone); ``deadline_ms`` (its maximum age)
    and ``idle_limit_ms`` (the longest it may go without a request, since ``last_request_ms``)
    bound a session however often it is heartbeated (:class:`pool.store.Terms`).
    """

    rollout_id: str
    replica_id: str
    generation: int
    label: str
    identity_digest: str
    state: BindingState
    session: bool = False
    created_ms: int
    finished_ms: int | None = None
    lease_expires_ms: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    reason: str = ""
    client: str = ""
    deadline_ms: int | None = None
    idle_limit_ms: int | None = None
    last_request_ms: int | None = None


class GenerationRecord(_Frozen):
    """A generation the updater declared: the identity it must carry, where its checkpoint is,
    and the validation probe (greedy output of ``probe_prompt`` must equal ``probe_expected``)
    that every replica loading it — updated or freshly restarted — must pass. ``adapter``: in
    a pool whose generations are LoRA adapters, the name it is served under (``checkpoint`` is
    then the adapter's directory); '' for full weights and for the base model."""

    generation: Generation
    identity: WeightIdentity
    checkpoint: str = ""
    probe_prompt: tuple[int, ...] = ()
    probe_expected: tuple[int, ...] = ()
    adapter: str = ""
