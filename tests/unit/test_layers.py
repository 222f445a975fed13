"""The import layering (README "Where things live"): every import of every module is checked.

* ``pool`` is the core: it imports neither ``router`` nor ``updater``;
* product code (``pool``, ``router``, ``updater``) never imports ``testkit``, ``tests`` or
  ``bench``; ``rolloutpool`` (CLI, embedded pool, demo) may use ``testkit``, never the other two;
* ``testkit`` imports neither ``tests`` nor ``bench``; ``bench`` never imports ``tests``;
  ``tests`` never import ``bench``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN: dict[str, frozenset[str]] = {
    "pool": frozenset({"router", "updater", "rolloutpool", "testkit", "tests", "bench"}),
    "router": frozenset({"updater", "rolloutpool", "testkit", "tests", "bench"}),
    "updater": frozenset({"router", "rolloutpool", "testkit", "tests", "bench"}),
    "rolloutpool": frozenset({"tests", "bench"}),
    "testkit": frozenset({"tests", "bench"}),
    "bench": frozenset({"tests"}),
    "tests": frozenset({"bench"}),
}


def imported_packages(path: Path) -> set[str]:
    """Top-level package names imported anywhere in ``path`` (function bodies included)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def violations(layer: str) -> list[str]:
    bad: list[str] = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        hits = imported_packages(path) & FORBIDDEN[layer]
        bad += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(hits)]
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    assert violations(layer) == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tests.integration import conftest\n    import bench.x\n")
    assert imported_packages(module) >= {"tests", "bench"}
