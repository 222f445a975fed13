"""The docs' reference pages are generated from the code (``scripts/docs_reference.py``): a
setting, CLI option or endpoint changed without regenerating its page fails here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from tests.helpers import run_python

ROOT = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "scripts/docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_match_the_code() -> None:
    assert generator().stale() == [], "run: .venv/bin/python scripts/docs_reference.py"


def test_the_cli_page_is_the_same_after_the_cli_ran_in_the_process() -> None:
    """click caches a command's help option from the first context that asks for it; the page
    must not depend on whether the CLI (with its ``-h``) already ran in the generating process,
    as it may have in a test worker. A fresh process: every command's help first, then the page."""
    code = (
        "import importlib.util, sys\n"
        "from click.testing import CliRunner\n"
        "from rolloutpool.cli import cli\n"
        "for name in sorted(cli.commands):\n"
        "    CliRunner().invoke(cli, [name, '--help'])\n"
        "spec = importlib.util.spec_from_file_location('g', 'scripts/docs_reference.py')\n"
        "g = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(g)\n"
        "sys.stdout.write(g.cli_page())\n"
    )
    assert run_python(code) == (ROOT / "docs/reference/cli.md").read_text()


def test_every_setting_is_on_the_configuration_page() -> None:
    from pool.settings import StoreSettings
    from router.settings import RouterSettings
    from updater.settings import UpdaterSettings

    page = (ROOT / "docs/reference/configuration.md").read_text()
    for cls, prefix in (
        (StoreSettings, "ROLLOUTPOOL_REDIS_"),
        (RouterSettings, "ROLLOUTPOOL_ROUTER_"),
        (UpdaterSettings, "ROLLOUTPOOL_UPDATER_"),
    ):
        for name in cls.model_fields:
            assert f"env `{prefix}{name.upper()}`" in page, name


def quick_start(path: Path) -> list[tuple[str, str]]:
    """The (language, code) blocks of a page's quick start: from its "Quick start" heading to
    the line that starts with "More:"."""
    text = path.read_text()
    head = re.search(r"^#+ Quick start$", text, re.M)
    assert head is not None, path
    section = text[head.end() : text.index("\nMore:", head.end())]
    return [(m[1], m[2]) for m in re.finditer(r"```(\w+)\n(.*?)```", section, re.S)]


def test_the_docs_quick_start_is_the_readmes() -> None:
    """tests/integration/test_quickstart.py runs the README's; the docs page must not drift."""
    readme = quick_start(ROOT / "README.md")
    assert [lang for lang, _ in readme] == ["bash", "bash", "python", "bash"]
    assert quick_start(ROOT / "docs/guides/quickstart.md") == readme


def test_a_markdown_page_turns_rst_roles_into_code() -> None:
    text = "See :class:`~pool.errors.StoreBusy` and :mod:`pool.store` for ``x``."
    assert generator().markdown(text) == "See `StoreBusy` and `pool.store` for `x`."
