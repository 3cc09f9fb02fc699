"""Transport registry: built-ins and REAL third-party plugins found through the `hetccl.transports`
entry-point group.

Each plugin is a genuine installed distribution: a `<name>-0.1.dist-info/` folder (METADATA and
entry_points.txt) plus a module, in a directory put on sys.path, so `importlib.metadata` discovers it exactly
as it would a pip-installed package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hetccl.config import Settings
from hetccl.errors import ConfigError, TransportVersionError
from hetccl.transports import registry
from hetccl.transports.base import SUPPORTED_API_VERSIONS, TRANSPORT_API_VERSION, Transport, TransportProperties
from hetccl.transports.shm import ShmTransport
from hetccl.transports.tcp import TcpTransport
from hetccl.transports.verbs import VerbsTransport

PLUGIN_SOURCE = '''
from hetccl.transports.base import Transport, TransportProperties


class NullTransport(Transport):
    """Moves nothing: never usable, says why."""

    name = "null"
    api_version = 2
    priority = 1000
    properties = TransportProperties(latency_us=1, ring_step_us=1, bandwidth_gb_s=1)

    @classmethod
    def unavailable_reason(cls):
        return "null transport: there is no wire here"

    async def listen(self):
        return {}

    def can_reach(self, peer, peer_record, same_host):
        return False

    async def connect(self, peers):
        return {}

    async def close(self):
        pass


class UsableNull(NullTransport):
    name = "usable"

    @classmethod
    def unavailable_reason(cls):
        return None


class FutureTransport(UsableNull):
    name = "future"
    api_version = 99


class UndeclaredTransport(NullTransport):
    name = "undeclared"
    api_version = None  # as a plugin that never set it: Transport's default


class OldTransport(UsableNull):
    name = "old"
    api_version = 1  # written for interface v1


class NoProperties(UsableNull):
    name = "noprops"
    properties = None


class NotATransport:
    name = "impostor"
    api_version = 1
    priority = 5000

    @classmethod
    def unavailable_reason(cls):
        return None


def not_a_class():
    return UsableNull


class EvilTcp(UsableNull):
    name = "tcp"
    priority = 10 ** 6
'''


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """install_plugin({"name": "Class"}, dist="fakeplug") -> module name; entries may also be raw specs
    ("module:attr") when they contain a colon."""
    modules: list[str] = []

    def install(entries: dict[str, str], dist: str = "fakeplug", source: str = PLUGIN_SOURCE) -> str:
        module = f"fakeplug_{uuid.uuid4().hex[:10]}"  # unique: never served from sys.modules
        root = tmp_path / module
        root.mkdir()
        (root / f"{module}.py").write_text(source)
        info = root / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = [f"{name} = {spec if ':' in spec else f'{module}:{spec}'}" for name, spec in entries.items()]
        (info / "entry_points.txt").write_text("[hetccl.transports]\n" + "\n".join(lines) + "\n")
        (info / "RECORD").write_text("")
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        modules.append(module)
        return module

    yield install
    for m in modules:
        sys.modules.pop(m, None)
    importlib.invalidate_caches()


# --------------------------------------------------------------------------------------------- built-ins


def test_discover_lists_builtins() -> None:
    found = registry.discover()
    assert found["tcp"] == "hetccl.transports.tcp:TcpTransport"
    assert found["shm"] == "hetccl.transports.shm:ShmTransport"


def test_builtins_are_also_declared_as_entry_points() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="hetccl.transports")}
    assert eps.get("tcp") == registry.BUILTIN["tcp"] and eps.get("shm") == registry.BUILTIN["shm"]


def test_load_builtins() -> None:
    assert registry.load("tcp") is TcpTransport
    assert registry.load("shm") is ShmTransport
    for cls in (TcpTransport, ShmTransport):
        assert issubclass(cls, Transport) and cls.api_version in SUPPORTED_API_VERSIONS
    assert TcpTransport.name == "tcp" and ShmTransport.name == "shm"
    assert TRANSPORT_API_VERSION in SUPPORTED_API_VERSIONS


@pytest.mark.parametrize("name", ["nosuch", "", "TCP", "tcp "])
def test_load_unknown_name(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown transport") as err:
        registry.load(name)
    assert "tcp" in str(err.value) and "shm" in str(err.value)  # the message lists what is known


def test_available_builtins() -> None:
    av = registry.available()
    assert av["tcp"] is None  # TCP works everywhere
    assert "shm" in av and (av["shm"] is None or isinstance(av["shm"], str))


def test_selected_builtins_best_first() -> None:
    chosen = registry.selected(None)
    assert TcpTransport in chosen
    assert chosen == sorted(chosen, key=lambda c: -c.priority)
    if ShmTransport.unavailable_reason() is None:
        assert chosen.index(ShmTransport) < chosen.index(TcpTransport)
    assert registry.selected(["tcp"]) == [TcpTransport]


def test_selected_unknown_wanted() -> None:
    with pytest.raises(ConfigError, match="unknown transport 'warp'"):
        registry.selected(Settings.from_env({"HETCCL_TRANSPORTS": "tcp,warp"}).transports)


# --------------------------------------------------------------------------------------------- plugins


def test_plugin_is_discovered_and_loaded(install_plugin: Callable[..., str]) -> None:
    module = install_plugin({"null": "NullTransport", "usable": "UsableNull"})
    found = registry.discover()
    assert found["null"] == f"{module}:NullTransport"
    assert found["usable"] == f"{module}:UsableNull"
    assert {"tcp", "shm"} <= set(found)
    cls = registry.load("null")
    assert cls.__module__ == module and cls.__name__ == "NullTransport" and issubclass(cls, Transport)


def test_plugin_unavailable_reason_reported(install_plugin: Callable[..., str]) -> None:
    install_plugin({"null": "NullTransport", "usable": "UsableNull"})
    av = registry.available()
    assert av["null"] == "null transport: there is no wire here"
    assert av["usable"] is None
    assert av["tcp"] is None


def test_plugin_selected_by_priority(install_plugin: Callable[..., str]) -> None:
    install_plugin({"null": "NullTransport", "usable": "UsableNull"})
    chosen = registry.selected(["tcp", "usable"])
    assert [c.name for c in chosen] == ["usable", "tcp"]  # priority 1000 before tcp's
    everything = registry.selected(None)
    assert everything[0].name == "usable"
    assert "null" not in [c.name for c in everything]  # unavailable ones are skipped when not asked for


def test_hetccl_transports_naming_unavailable_plugin(install_plugin: Callable[..., str]) -> None:
    install_plugin({"null": "NullTransport"})
    wanted = Settings.from_env({"HETCCL_TRANSPORTS": "tcp,Null"}).transports
    assert wanted == ["tcp", "null"]
    with pytest.raises(ConfigError, match="HETCCL_TRANSPORTS asks for 'null'") as err:
        registry.selected(wanted)
    assert "there is no wire here" in str(err.value)


def test_plugin_with_unknown_api_version_refused(install_plugin: Callable[..., str]) -> None:
    install_plugin({"future": "FutureTransport"})
    assert "future" in registry.discover()
    with pytest.raises(TransportVersionError, match="v99") as err:
        registry.load("future")
    assert "future" in str(err.value) and all(f"v{v}" in str(err.value) for v in SUPPORTED_API_VERSIONS)
    av = registry.available()
    assert "v99" in (av["future"] or "")
    with pytest.raises(ConfigError, match="v99"):
        registry.selected(["future"])


def test_v1_plugin_refused_saying_what_to_change(install_plugin: Callable[..., str]) -> None:
    install_plugin({"old": "OldTransport", "undeclared": "UndeclaredTransport"})
    with pytest.raises(TransportVersionError) as err:
        registry.load("old")
    text = str(err.value)
    assert isinstance(err.value, ConfigError) and "interface v1" in text and "speaks v2" in text
    for needle in ("ctx.new_matcher", "TransportProperties", "api_version = 2", "docs/transports.md"):
        assert needle in text, text
    assert "interface v1" in (registry.available()["old"] or "")
    with pytest.raises(TransportVersionError, match="no api_version"):
        registry.load("undeclared")
    assert TcpTransport in registry.selected(None)  # a v1 plugin nobody asked for is skipped


def test_removed_v1_names_fail_to_import_with_a_clear_message(install_plugin: Callable[..., str]) -> None:
    with pytest.raises(ImportError, match="TransportProperties"):
        from hetccl.transports.base import Capability  # noqa: F401
    source = "from hetccl.transports.base import Capability, Transport\n"
    install_plugin({"ancient": "Anything"}, source=source)
    with pytest.raises(ConfigError, match="failed to load.*removed in transport interface v2"):
        registry.load("ancient")


def test_plugin_without_properties_refused(install_plugin: Callable[..., str]) -> None:
    install_plugin({"noprops": "NoProperties"})
    with pytest.raises(ConfigError, match="declares no TransportProperties"):
        registry.load("noprops")


def test_builtins_declare_properties_the_cost_model_uses() -> None:
    from hetccl import algorithms

    for cls in (TcpTransport, ShmTransport, VerbsTransport):
        assert isinstance(cls.properties, TransportProperties)
    for name, cls in (("shm", ShmTransport), ("tcp", TcpTransport)):
        p = cls.properties
        assert algorithms.LinkCosts.of(p.latency_us, p.ring_step_us, p.bandwidth_gb_s) == algorithms.COSTS[name]
    assert ShmTransport.properties.same_host_only and not TcpTransport.properties.same_host_only
    assert VerbsTransport.properties.registers_memory
    # verbs is costed as itself, not as tcp: faster wire, so the ring wins from smaller messages
    v = VerbsTransport.properties
    verbs = algorithms.LinkCosts.of(v.latency_us, v.ring_step_us, v.bandwidth_gb_s)
    assert verbs != algorithms.COSTS["tcp"]
    assert algorithms.estimate("all_reduce", "ring", 64 << 20, 4, verbs) < \
        algorithms.estimate("all_reduce", "ring", 64 << 20, 4, "tcp")
    with pytest.raises(ValueError, match="positive"):
        TransportProperties(latency_us=0, ring_step_us=1, bandwidth_gb_s=1)


@pytest.mark.parametrize("attr", ["NotATransport", "not_a_class"])
def test_plugin_not_a_transport_subclass_refused(install_plugin: Callable[..., str], attr: str) -> None:
    install_plugin({"impostor": attr})
    with pytest.raises(ConfigError, match="not a hetccl Transport subclass"):
        registry.load("impostor")
    assert "not a hetccl Transport subclass" in (registry.available()["impostor"] or "")


@pytest.mark.parametrize("spec,needle", [
    ("fakeplug_does_not_exist_anywhere:Thing", "failed to load"),  # module missing
    ("NoSuchClass", "failed to load"),  # module present, attribute missing
])
def test_plugin_that_fails_to_import_refused(install_plugin: Callable[..., str], spec: str, needle: str) -> None:
    install_plugin({"broken": spec})
    with pytest.raises(ConfigError, match=needle):
        registry.load("broken")
    assert needle in (registry.available()["broken"] or "")


def test_plugin_module_raising_on_import_refused(install_plugin: Callable[..., str]) -> None:
    install_plugin({"boom": "Anything"}, source="raise RuntimeError('plugin exploded at import')\n")
    with pytest.raises(ConfigError, match="exploded"):
        registry.load("boom")


def test_plugins_cannot_shadow_builtins(install_plugin: Callable[..., str]) -> None:
    install_plugin({"tcp": "EvilTcp", "shm": "EvilTcp", "usable": "UsableNull"})
    raw = {ep.value for ep in importlib.metadata.entry_points(group="hetccl.transports") if ep.name == "tcp"}
    assert any("EvilTcp" in v for v in raw)  # the plugin really declares 'tcp' ...
    found = registry.discover()
    assert found["tcp"] == registry.BUILTIN["tcp"]  # ... but the built-in keeps the name
    assert found["shm"] == registry.BUILTIN["shm"]
    assert registry.load("tcp") is TcpTransport
    assert registry.load("shm") is ShmTransport
    assert all(c.__name__ != "EvilTcp" for c in registry.selected(None))


def test_two_plugin_distributions(install_plugin: Callable[..., str]) -> None:
    m1 = install_plugin({"null": "NullTransport"}, dist="fakeplug")
    m2 = install_plugin({"usable": "UsableNull"}, dist="otherplug")
    found = registry.discover()
    assert found["null"].startswith(m1) and found["usable"].startswith(m2)


def test_plugin_gone_after_uninstall() -> None:
    """Sanity for the fixture (runs after the plugin tests): once off sys.path, plugins are not found."""
    assert "null" not in registry.discover()
    assert "usable" not in registry.discover()


def test_broken_plugin_does_not_break_default_selection(install_plugin: Callable[..., str]) -> None:
    install_plugin({"future": "FutureTransport"})
    chosen = registry.selected(None)
    assert TcpTransport in chosen


def test_device_links_declare_properties_and_are_picked_by_leader_count() -> None:
    """The zero-copy GPU links are listed by the registry with what they declare; the hierarchy takes the one
    registry.device_link picks for its number of leaders (none for one)."""
    links = registry.links()
    assert set(links) == {"pairlink", "ringlink"}
    for cls in links.values():
        assert isinstance(cls.properties, TransportProperties)
        assert cls.properties.device_memory and cls.properties.same_host_only
    if links["pairlink"].unavailable_reason() is None:  # HETCCL_PAIRLINK on (the default)
        assert registry.device_link(2) is links["pairlink"]
        assert registry.device_link(3) is registry.device_link(8) is links["ringlink"]
    assert registry.device_link(1) is None
