"""What the router attaches to responses, and the ``weight_versions`` check (I7). No I/O.

* :class:`RolloutInfo` is the binding's provenance as a client sees it: the ``rollout`` object
  added to every JSON body and the ``X-Rollout-*`` headers added to every response of an
  admitted request.
* :class:`SpanCheck` collects vLLM's per-choice ``weight_versions`` spans (one response, or the
  chunks of one stream) and decides whether they prove the rollout stayed on its generation:
  for every choice that reports spans there must be **exactly one span, whose version equals the
  bound label**; an empty list is accepted only if that choice generated no tokens. Choices
  that carry no ``weight_versions`` field (``/v1/completions`` before vLLM 0.33) are not checked.
  In a LoRA pool every body must also name the rollout's adapter as its ``model`` (vLLM names
  the model that generated it): another name is a violation too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pool.store import Admission
from pool.types import Binding

HEADER_ID = "X-Rollout-Id"
HEADER_GENERATION = "X-Rollout-Generation"
HEADER_LABEL = "X-Rollout-Label"
HEADER_IDENTITY = "X-Rollout-Identity"
HEADER_REPLICA = "X-Rollout-Replica"


def new_rollout_id() -> str:
    """A fresh, unguessable rollout id (it doubles as the capability to use a session)."""
    return "ro-" + os.urandom(16).hex()  # 32 hex digits like uuid4().hex, 128 random bits


@dataclass(frozen=True)
class RolloutInfo:
    """One rollout's binding as reported to the client."""

    rollout_id: str
    generation: int
    label: str
    identity_digest: str
    replica_id: str

    @classmethod
    def of_admission(cls, a: Admission) -> RolloutInfo:
        return cls(a.rollout_id, a.generation, a.label, a.identity_digest, a.replica_id)

    @classmethod
    def of_binding(cls, b: Binding) -> RolloutInfo:
        return cls(b.rollout_id, b.generation, b.label, b.identity_digest, b.replica_id)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.rollout_id,
            "generation": self.generation,
            "label": self.label,
            "identity_digest": self.identity_digest,
            "replica": self.replica_id,
        }

    def headers(self) -> dict[str, str]:
        return {
            HEADER_ID: self.rollout_id,
            HEADER_GENERATION: str(self.generation),
            HEADER_LABEL: self.label,
            HEADER_IDENTITY: self.identity_digest,
            HEADER_REPLICA: self.replica_id,
        }


def usage_tokens(body: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from an OpenAI ``usage`` object, if present."""
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt, completion
    return None


@dataclass
class _Choice:
    spans: list[Any] | None = None  # None: the choice never reported spans
    tokens: int | None = None  # token ids seen (None: the response carries no token ids)


@dataclass
class SpanCheck:
    """Accumulates spans per choice index; :meth:`violation` gives the verdict.

    Feed it whole responses (:meth:`observe`) or every chunk of a stream (spans arrive on a
    choice's last chunk; token ids are counted across chunks).
    """

    label: str
    #: The ``model`` every body must name (a LoRA pool: the rollout's adapter); None: unchecked.
    model: str | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    completion_tokens: int | None = None
    wrong_model: str | None = None

    def observe(self, body: Mapping[str, Any]) -> None:
        named = body.get("model")
        if self.model is not None and named is not None and named != self.model:
            self.wrong_model = str(named)[:200]
        usage = usage_tokens(body)
        if usage is not None:
            self.completion_tokens = usage[1]
        raw = body.get("choices")
        if not isinstance(raw, list):
            return
        for pos, choice in enumerate(raw):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", pos)
            state = self.choices.setdefault(index if isinstance(index, int) else pos, _Choice())
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                state.tokens = (state.tokens or 0) + len(ids)
            spans = choice.get("weight_versions")
            if spans is not None:
                state.spans = (state.spans or []) + (spans if isinstance(spans, list) else [spans])

    def violation(self) -> str | None:
        """None if every reported span list proves the bound label (and every body named the
        expected model); else the reason."""
        if self.wrong_model is not None:
            return (
                f"the answer was generated by {self.wrong_model!r}, but the rollout is bound "
                f"to {self.model!r}"
            )
        for index in sorted(self.choices):
            c = self.choices[index]
            if c.spans is None:
                continue
            versions = [s.get("version") if isinstance(s, dict) else s for s in c.spans]
            if not versions:
                generated = c.tokens if c.tokens is not None else self.completion_tokens
                if generated == 0:
                    continue
                what = "tokens" if generated is None else f"{generated} tokens"
                return f"choice {index}: no weight_versions span for the generated {what}"
            if len(versions) > 1:
                return (
                    f"choice {index}: {len(versions)} weight_versions spans {versions!r}; "
                    f"a rollout must be sampled under one weight version ({self.label!r})"
                )
            if versions[0] != self.label:
                return (
                    f"choice {index}: tokens were sampled under weight version "
                    f"{versions[0]!r}, but the rollout is bound to {self.label!r}"
                )
        return None


def check_response(body: Mapping[str, Any], label: str, model: str | None = None) -> str | None:
    """The span (and ``model``) verdict for one complete (non-streamed) response body."""
    check = SpanCheck(label, model)
    check.observe(body)
    return check.violation()
