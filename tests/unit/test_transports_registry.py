"""``updater.transports.registry``: transports by name, imported only when asked for, and the
settings that name one."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from updater.settings import UpdaterSettings
from updater.transports import registry
from updater.transports.ipc import IpcDirectTransport
from updater.transports.nccl import NcclConfig, NcclTransport
from updater.transports.registry import TransportRegistry
from updater.transports.reload import ReloadTransport

PLUGIN = """
from updater.transports.reload import ReloadTransport


class PluginTransport(ReloadTransport):
    name = "plugin"


NOT_A_TRANSPORT = 42
"""


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module with a transport in it that nothing has imported yet."""
    name = f"plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_a_name_can_be_registered_once() -> None:
    reg = TransportRegistry()
    reg.register("a", "some.module", "A")
    with pytest.raises(ValueError, match=r"'a' is already registered \(some.module.A\)"):
        reg.register("a", "other.module", "B")
    assert reg.names() == ["a"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register("reload", "elsewhere", "Reload")  # the built-ins are taken too


def test_an_unknown_name_lists_the_registered_ones() -> None:
    reg = TransportRegistry()
    with pytest.raises(ValueError, match="unknown transport 'x'; registered: none"):
        reg.get("x")
    reg.register("b", "m", "B")
    reg.register("a", "m", "A")
    with pytest.raises(ValueError, match="unknown transport 'x'; registered: a, b"):
        reg.require("x")
    with pytest.raises(ValueError, match="registered: ipc_direct, nccl, nccl_direct, reload"):
        registry.get("carrier-pigeon")


def test_the_module_is_imported_when_the_class_is_asked_for(plugin_module: str) -> None:
    reg = TransportRegistry()
    reg.register("plugin", plugin_module, "PluginTransport")
    assert reg.require("plugin") == "plugin"
    assert plugin_module not in sys.modules  # registering and validating import nothing
    cls = reg.get("plugin")
    assert plugin_module in sys.modules
    assert cls.__name__ == "PluginTransport" and issubclass(cls, ReloadTransport)


def test_a_registration_that_is_not_a_transport_is_refused_when_used(plugin_module: str) -> None:
    reg = TransportRegistry()
    reg.register("number", plugin_module, "NOT_A_TRANSPORT")
    reg.register("nothing", plugin_module, "Missing")
    with pytest.raises(TypeError, match="is not a Transport"):
        reg.get("number")
    with pytest.raises(AttributeError):
        reg.get("nothing")


def test_the_built_ins_are_built_from_the_settings() -> None:
    assert registry.names() == ["ipc_direct", "nccl", "nccl_direct", "reload"]
    reload = registry.create(UpdaterSettings())
    assert isinstance(reload, ReloadTransport) and not reload.checksums
    reload = registry.create(UpdaterSettings(checksums=True))
    assert isinstance(reload, ReloadTransport) and reload.checksums
    nccl = NcclConfig(master_port=30000)
    for name in ("nccl", "nccl_direct"):
        transport = registry.create(UpdaterSettings(transport=name, nccl=nccl))
        assert isinstance(transport, NcclTransport) and transport.name == name
        assert transport.config == nccl and transport.source is None  # service mode
        transport.close()
    ipc = registry.create(UpdaterSettings(transport="ipc_direct"))
    assert isinstance(ipc, IpcDirectTransport) and ipc.staging is None  # service mode
    assert isinstance(ipc.fallback, ReloadTransport) and ipc.fallback.checksums


def test_settings_accept_the_registered_names_only(
    plugin_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError, match="unknown transport 'carrier-pigeon'; registered"):
        UpdaterSettings(transport="carrier-pigeon")
    # a transport registered before the settings are built is accepted (the entry is removed
    # again after the test: the global registry has no unregister)
    monkeypatch.setitem(registry._REGISTRY._entries, "plugin", (plugin_module, "PluginTransport"))
    assert UpdaterSettings(transport="plugin").transport == "plugin"
    assert plugin_module not in sys.modules  # validated by name only
    assert type(registry.create(UpdaterSettings(transport="plugin"))).__name__ == (
        "PluginTransport"
    )
