"""pool.paths: the cache and results directories, in a checkout and installed."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from pool import paths

ROOT = Path(__file__).resolve().parents[2]


def installed_copy(site_packages: Path) -> ModuleType:
    """``pool/paths.py`` loaded from ``site_packages/pool/paths.py``, as a wheel installs it
    (no ``pyproject.toml`` above the package)."""
    target = site_packages / "pool" / "paths.py"
    target.parent.mkdir(parents=True)
    shutil.copy(paths.__file__, target)
    spec = importlib.util.spec_from_file_location("installed_pool_paths", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ROLLOUTPOOL_CACHE", "ROLLOUTPOOL_RESULTS", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_overrides")
def test_a_checkout_uses_its_own_directories() -> None:
    assert paths.checkout_root() == ROOT
    assert paths.default_cache_root() == ROOT / ".cache"
    assert paths.default_results_dir() == ROOT / "bench" / "results"


@pytest.mark.usefixtures("no_overrides")
def test_an_installed_package_uses_the_users_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = installed_copy(tmp_path / "site-packages")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert installed.checkout_root() is None
    assert installed.default_cache_root() == tmp_path / "home" / ".cache" / "rolloutpool"
    assert installed.default_results_dir() == (
        tmp_path / "home" / ".local" / "share" / "rolloutpool" / "results"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xc"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xd"))
    assert installed.default_cache_root() == tmp_path / "xc" / "rolloutpool"
    assert installed.default_results_dir() == tmp_path / "xd" / "rolloutpool" / "results"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the spec ignores relative paths
    assert installed.default_cache_root() == tmp_path / "home" / ".cache" / "rolloutpool"


@pytest.mark.usefixtures("no_overrides")
def test_a_pyproject_of_another_project_is_not_a_checkout(tmp_path: Path) -> None:
    installed = installed_copy(tmp_path / "other")
    (tmp_path / "other" / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert installed.checkout_root() is None


@pytest.mark.usefixtures("no_overrides")
def test_the_variables_win_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed = installed_copy(tmp_path / "site-packages")
    monkeypatch.setenv("ROLLOUTPOOL_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("ROLLOUTPOOL_RESULTS", str(tmp_path / "r"))
    for module in (paths, installed):
        assert module.default_cache_root() == tmp_path / "c"
        assert module.default_results_dir() == tmp_path / "r"
