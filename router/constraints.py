"""What a client demands of the generation its rollout runs on: :class:`Constraints`
(``min_generation`` and/or an exact ``generation``), from the ``X-Rollout-*`` headers, the body
of ``POST /v1/rollouts`` or a request's ``rollout`` field, and :func:`check_satisfiable`, which
refuses (409 ``generation_unsatisfiable``) constraints no admissible generation meets.

Pure: no I/O. The store's ADMIT script checks the constraints again on the replica it binds
(:mod:`router.admission`); these checks only refuse early what it would refuse anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pool.types import Generation
from pool.web import BadRequest, Conflict, validate_strictly

HEADER_MIN_GENERATION = "X-Rollout-Min-Generation"
HEADER_GENERATION = "X-Rollout-Generation"


class GenerationUnsatisfiable(Conflict):
    code = "generation_unsatisfiable"


class Constraints(BaseModel):
    """What a client demands of the generation: ``min_generation`` and/or exact ``generation``.

    Also the body of ``POST /v1/rollouts`` and of the optional ``rollout`` request field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_generation: int | None = Field(default=None, ge=0)
    generation: int | None = Field(default=None, ge=0)

    @classmethod
    def parse(cls, raw: Any, where: str, *, strict: bool = True) -> Constraints:
        """Validate ``raw``; strictly by default (a JSON ``false`` is not generation 0).

        Raises :class:`BadRequest` (400 ``invalid_constraints``).
        """
        try:
            return validate_strictly(cls, raw) if strict else cls.model_validate(raw)
        except ValidationError as e:
            errors = [f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()]
            raise BadRequest(
                f"invalid {where}: {'; '.join(errors)}", code="invalid_constraints"
            ) from e

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Constraints:
        raw: dict[str, str] = {}
        for header, name in (
            (HEADER_MIN_GENERATION, "min_generation"),
            (HEADER_GENERATION, "generation"),
        ):
            if header in headers:
                raw[name] = headers[header].strip()
        return cls.parse(raw, "X-Rollout-* headers", strict=False) if raw else cls()

    def merge(self, other: Constraints) -> Constraints:
        """Both sources together; contradicting exact generations are unsatisfiable (409)."""
        if (
            self.generation is not None
            and other.generation is not None
            and self.generation != other.generation
        ):
            raise GenerationUnsatisfiable(
                f"conflicting exact generations {self.generation} and {other.generation}",
                requested=[self.generation, other.generation],
            )
        mins = [m for m in (self.min_generation, other.min_generation) if m is not None]
        return Constraints(
            min_generation=max(mins) if mins else None,
            generation=self.generation if self.generation is not None else other.generation,
        )

    def allows(self, generation: int) -> bool:
        if self.min_generation is not None and generation < self.min_generation:
            return False
        return self.generation is None or generation == self.generation


def check_satisfiable(
    latest: Generation | None, constraints: Constraints, max_staleness: int
) -> None:
    """Raise :class:`GenerationUnsatisfiable` if no admissible generation meets the constraints.

    Admissible = ``[latest - max_staleness, latest]``. Before the first publish nothing is
    decided here (the caller waits for a replica like any other shortage).
    """
    if latest is None:
        return
    low, high = latest.number - max_staleness, latest.number
    g, m = constraints.generation, constraints.min_generation
    ctx: dict[str, Any] = {
        "latest": high,
        "oldest_admissible": low,
        "max_staleness": max_staleness,
    }
    if g is not None and g > high:
        raise GenerationUnsatisfiable(
            f"generation {g} is newer than the latest published generation {high}",
            requested=g,
            **ctx,
        )
    if g is not None and g < low:
        raise GenerationUnsatisfiable(
            f"generation {g} is older than the oldest admissible generation {low} "
            f"(latest {high}, max_staleness {max_staleness})",
            requested=g,
            **ctx,
        )
    if m is not None and m > high:
        raise GenerationUnsatisfiable(
            f"min_generation {m} is newer than the latest published generation {high}",
            requested_min=m,
            **ctx,
        )
    if g is not None and m is not None and g < m:
        raise GenerationUnsatisfiable(
            f"generation {g} contradicts min_generation {m}", requested=g, requested_min=m, **ctx
        )
