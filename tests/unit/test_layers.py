"""The import layering (docs/concepts/architecture.md): every import of every module is checked,
those under ``if TYPE_CHECKING:`` and those inside functions included.

* ``pool`` is the core: it imports neither ``router`` nor ``updater``;
* the product (``pool``, ``router``, ``updater``, ``rolloutpool``) never imports ``testkit``,
  ``tests`` or ``bench``;
* ``testkit`` imports neither ``tests`` nor ``bench``; ``bench`` never imports ``tests``;
  ``tests`` never import ``bench``;
* no module of the product takes part in an import cycle;
* no file of the product is longer than :data:`MAX_LINES` lines.

The module graph: a module's edges are the modules its import statements name. ``import a.b.c``
and ``from a.b import c`` (``c`` a module) are edges to ``a.b.c``; ``from a.b import name`` (not
a module) is an edge to ``a.b``, i.e. the package's ``__init__``. Python runs the packages above
a module first, but a package whose ``__init__`` re-exports its own modules is not a cycle, so
those implicit imports are not edges. A cycle is a strongly connected component of more than one
module (Tarjan's algorithm).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRODUCT = ("pool", "router", "updater", "rolloutpool")
MAX_LINES = 600

FORBIDDEN: dict[str, frozenset[str]] = {
    "pool": frozenset({"router", "updater", "rolloutpool", "testkit", "tests", "bench"}),
    "router": frozenset({"updater", "rolloutpool", "testkit", "tests", "bench"}),
    "updater": frozenset({"router", "rolloutpool", "testkit", "tests", "bench"}),
    "rolloutpool": frozenset({"testkit", "tests", "bench"}),
    "testkit": frozenset({"tests", "bench"}),
    "bench": frozenset({"tests"}),
    "tests": frozenset({"bench"}),
}


def module_name(path: Path, root: Path) -> str:
    """``a/b/__init__.py`` -> ``a.b``; ``a/b/c.py`` -> ``a.b.c``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    return {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }


def imported_names(path: Path, name: str) -> Iterator[str]:
    """The dotted names ``path`` (module ``name``) imports, anywhere in it (function bodies and
    ``if TYPE_CHECKING:`` blocks included), relative imports resolved: ``import a.b`` yields
    ``a.b``, ``from a import b`` yields ``a.b`` (``b`` a module or a name defined in ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = package.split(".")
                source = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [source])])
            yield from (f"{source}.{alias.name}" for alias in node.names)


def imported_packages(path: Path) -> set[str]:
    """Top-level package names imported anywhere in ``path`` (function bodies included)."""
    return {n.split(".")[0] for n in imported_names(path, path.stem)}


def resolve(imported: str, mods: dict[str, Path]) -> str | None:
    """The module ``imported`` refers to: itself, or the nearest module above it (``a.b.name``
    -> ``a.b``); None outside ``mods``."""
    while imported and imported not in mods:
        imported = imported.rpartition(".")[0]
    return imported or None


def module_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (see the module docstring)."""
    mods = modules(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {resolve(imported, mods) for imported in imported_names(path, name)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def violations(layer: str, root: Path = ROOT) -> list[str]:
    """``<path> imports <name>`` for each import of a package ``layer`` may not import."""
    bad: list[str] = []
    for name, path in modules(root, [layer]).items():
        for imported in sorted(set(imported_names(path, name))):
            if imported.split(".")[0] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(root)} imports {imported}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    assert violations(layer) == []


def test_no_module_of_the_product_takes_part_in_an_import_cycle() -> None:
    graph = module_graph(ROOT, PRODUCT)
    assert len(graph) > 100  # the whole product was read
    assert cycles(graph) == []


def test_no_product_file_is_longer_than_600_lines() -> None:
    lines = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in modules(ROOT, PRODUCT).values()
    }
    assert {name: n for name, n in lines.items() if n > MAX_LINES} == {}


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tests.integration import conftest\n    import bench.x\n")
    assert imported_packages(module) >= {"tests", "bench"}


@pytest.mark.parametrize("layer", PRODUCT)
def test_the_check_refuses_a_product_import_of_the_test_kit(layer: str, tmp_path: Path) -> None:
    (tmp_path / layer).mkdir()
    (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / layer / "m.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from testkit.harness import publish\n"
        "def f():\n"
        "    import testkit.redis_server\n"
    )
    assert violations(layer, tmp_path) == [
        f"{layer}/m.py imports testkit.harness.publish",
        f"{layer}/m.py imports testkit.redis_server",
    ]


def write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_sees_a_cycle_through_type_only_and_function_local_imports(
    tmp_path: Path,
) -> None:
    write_package(
        tmp_path,
        {
            "p/__init__.py": "from p.a import A\n",
            "p/a.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from p.sub import b\n"
            "class A: ...\n",
            "p/sub/__init__.py": "",
            "p/sub/b.py": "def f():\n    from ..c import C\n",
            "p/c.py": "from p import A\nclass C: ...\n",  # through the package's __init__
            "p/leaf.py": "import p.c\n",
        },
    )
    graph = module_graph(tmp_path, ["p"])
    assert graph["p.sub.b"] == {"p.c"}
    assert graph["p.c"] == {"p"}
    assert cycles(graph) == [["p", "p.a", "p.c", "p.sub.b"]]


def test_the_check_sees_no_cycle_in_a_package_that_re_exports_its_modules(tmp_path: Path) -> None:
    write_package(
        tmp_path,
        {
            "p/__init__.py": "from p.a import A\nfrom p.b import B\n",
            "p/a.py": "class A: ...\n",
            "p/b.py": "from p.a import A\nclass B(A): ...\n",
        },
    )
    assert cycles(module_graph(tmp_path, ["p"])) == []
