"""The parameter table (hetccl/params.py): parsing, caching, settings in code, README, and that nothing else in
the package reads the environment for a HETCCL_* setting."""

from __future__ import annotations

import ast
import importlib.util
import math
from pathlib import Path

import pytest

import hetccl
from hetccl import config, params
from hetccl.config import Settings
from hetccl.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hetccl"

# reads of a HETCCL_* variable outside the table that are allowed, and why
EXEMPT = {
    # runs at interpreter start-up of every rank of `hetccl run --torch-backend-alias`, before (and without)
    # importing hetccl; it reads only the variable `hetccl run` itself sets for it
    ("torch/alias/sitecustomize.py", "HETCCL_TORCH_ALIAS"),
}
_ENV_OBJECTS = ("os.environ", "environ")
_READ_CALLS = ("os.environ.get", "environ.get", "os.getenv", "getenv", "env_int", "env_float", "config.env_int",
               "config.env_float")


def env_reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) of every read of a HETCCL_* name from the environment or an environment-like mapping:
    os.environ.get / os.getenv / env_int / env_float calls, any ``.get("HETCCL_X")``, ``x["HETCCL_X"]`` loads
    and ``"HETCCL_X" in os.environ``. Writing a variable (a launcher setting a child's rank) is not a read."""
    found = []

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("HETCCL_"):
            return node.value
        return None

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            var = name_of(node.args[0])
            if var and (func in _READ_CALLS or func.endswith(".get")) and not func.startswith("params."):
                found.append((node.lineno, var))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            var = name_of(node.slice)
            if var and ast.unparse(node.value) not in ("params.TABLE", "TABLE"):
                found.append((node.lineno, var))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            var = name_of(node.left)
            if var and ast.unparse(node.comparators[0]) in _ENV_OBJECTS:
                found.append((node.lineno, var))
    return found


def test_the_checker_sees_reads() -> None:
    src = ('import os\nos.environ.get("HETCCL_A", "1")\nos.getenv("HETCCL_B")\nos.environ["HETCCL_C"]\n'
           '"HETCCL_D" in os.environ\nenv_int("HETCCL_E", 1, 0, 9)\nenv.get("HETCCL_F")\n'
           'os.environ["HETCCL_RANK"] = "0"\nd = {"HETCCL_G": 1}\nparams.get("HETCCL_H")\n'
           'params.TABLE["HETCCL_I"]\n')
    assert [v for _, v in env_reads(src)] == [f"HETCCL_{c}" for c in "ABCDEF"]


def test_no_module_reads_a_setting_outside_the_table() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "params.py":
            continue
        for line, var in env_reads(path.read_text()):
            if var in config.RANK_VARIABLES or (rel, var) in EXEMPT:
                continue
            bad.append(f"hetccl/{rel}:{line}: {var}")
    assert not bad, ("read these through hetccl.params (declare them in its TABLE), or, for who-am-I variables, "
                     "add them to config.RANK_VARIABLES:\n" + "\n".join(bad))


def test_rank_variables_are_not_parameters() -> None:
    assert not set(config.RANK_VARIABLES) & set(params.TABLE)


@pytest.mark.parametrize("p", params.TABLE.values(), ids=lambda p: p.name)
def test_every_parameter_is_well_formed_and_owned(p: params.Param) -> None:
    assert p.name.startswith("HETCCL_") and p.kind in params.KINDS and p.doc and "\n" not in p.doc
    assert (p.kind == "choice") == bool(p.choices)
    spec = importlib.util.find_spec(p.owner)
    assert spec is not None and spec.origin, f"{p.name}: owner {p.owner} is not a module"
    # the owner names it (a per-communicator one may be used only through its Settings field)
    assert p.field or p.name in Path(spec.origin).read_text(), f"{p.owner} does not mention {p.name}"
    assert params.parse(p, None) == p.default
    if not p.empty_error:
        assert params.parse(p, "  ") == p.default
    if p.field:
        assert hasattr(Settings(), p.field)


def test_readme_table_is_the_tables() -> None:
    text = (ROOT / "README.md").read_text()
    assert params.update_readme(text) == text, "README's environment table is stale: python -m hetccl.params --readme"


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("0", False), ("true", True), ("False", False),
                                            ("on", True), ("OFF", False), ("yes", True), ("no", False)])
def test_switches_parse_one_way(raw: str, value: bool) -> None:
    for name in ("HETCCL_PAIRLINK", "HETCCL_GPU_BLOCKING", "HETCCL_STORE_EXTERNAL", "HETCCL_HANG_REPORT"):
        assert params.lookup(name, {name: raw}) is value


@pytest.mark.parametrize(("name", "raw", "allowed"), [
    ("HETCCL_PAIRLINK", "maybe", "1/0, true/false, on/off or yes/no"),
    ("HETCCL_FLIGHT_RECORDS", "many", "whole number between 1 and"),
    ("HETCCL_FLIGHT_RECORDS", "0", "out of range"),
    ("HETCCL_SHM_SLOTS", "1", "between 2 and 4096"),
    ("HETCCL_SHM_SLOT_BYTES", "lots", "a size"),
    ("HETCCL_STAGE_BYTES", "1K", ">= 4K"),
    ("HETCCL_WATCHDOG_PERIOD_MS", "0", "> 0"),
    ("HETCCL_TORCH_CUDA", "fast", "direct or staged"),
    ("HETCCL_TRACE", " ", "set but empty"),
    ("HETCCL_METRICS_PORT", "http", "not a port"),
])
def test_bad_values_name_the_variable_and_what_is_allowed(name: str, raw: str, allowed: str) -> None:
    with pytest.raises(ConfigError, match=name) as err:
        params.lookup(name, {name: raw})
    assert allowed in str(err.value)


def test_values_of_each_kind() -> None:
    env = {"HETCCL_PAIRLINK_DIRECT_BYTES": "64K", "HETCCL_TRANSPORTS": " SHM, tcp ,", "HETCCL_DEBUG": "info",
           "HETCCL_REPORT_WAIT": "0.5", "HETCCL_IB_DEVICE": "rxe0,mlx5_1:2", "HETCCL_TEST_CLOCK_SKEW_US": "0,5e6"}
    assert params.lookup("HETCCL_PAIRLINK_DIRECT_BYTES", env) == 64 << 10
    assert params.lookup("HETCCL_TRANSPORTS", env) == ["shm", "tcp"]
    assert params.lookup("HETCCL_DEBUG", env) == "INFO"
    assert params.lookup("HETCCL_REPORT_WAIT", env) == 0.5
    assert params.lookup("HETCCL_IB_DEVICE", env) == [("rxe0", 1), ("mlx5_1", 2)]
    assert params.lookup("HETCCL_TEST_CLOCK_SKEW_US", env) == [0.0, 5e6]
    assert params.lookup("HETCCL_WAIT_NOTICE", {"HETCCL_WAIT_NOTICE": "0"}) == (math.inf, math.inf)


def test_read_once_until_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("HETCCL_FLIGHT_RECORDS", "9")
    assert params.get("HETCCL_FLIGHT_RECORDS") == 9 and params.is_set("HETCCL_FLIGHT_RECORDS")
    os.environ["HETCCL_FLIGHT_RECORDS"] = "10"  # behind the table's back: not seen until reload()
    assert params.get("HETCCL_FLIGHT_RECORDS") == 9
    params.reload()
    assert params.get("HETCCL_FLIGHT_RECORDS") == 10
    monkeypatch.setenv("HETCCL_FLIGHT_RECORDS", "x")
    for _ in range(2):  # a bad value is refused every time it is asked for
        with pytest.raises(ConfigError, match="HETCCL_FLIGHT_RECORDS='x'"):
            params.get("HETCCL_FLIGHT_RECORDS")
    with pytest.raises(KeyError, match="not a hetccl parameter"):
        params.get("HETCCL_NOPE")


def test_settings_defaults_come_from_the_table() -> None:
    s = Settings()
    for p in params.settings_params():
        if p.name != "HETCCL_SECRET":
            assert getattr(s, p.field) == p.default, p.name
    assert s.secret == b"" and Settings.from_env({}) == s


def test_settings_in_code_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETCCL_TIMEOUT", "40")
    monkeypatch.setenv("HETCCL_CHUNK_BYTES", "64K")
    s = Settings.build({"HETCCL_TIMEOUT": 7, "algo": "Ring", "chunk_bytes": "128K", "transports": ["TCP"]},
                       secret="abc")
    assert (s.timeout, s.algo, s.chunk_bytes, s.transports, s.secret) == (7.0, "ring", 128 << 10, ["tcp"], b"abc")
    assert Settings.build().chunk_bytes == 64 << 10  # the environment, when nothing is given in code
    assert Settings.build(timeout=3).timeout == 3.0
    given = Settings(timeout=5.0)
    built = Settings.build(given, secret=b"k")
    assert built.timeout == 5.0 and built.chunk_bytes is None and built.secret == b"k"  # a Settings: as given
    assert given.secret == b""  # not changed in place


@pytest.mark.parametrize(("settings", "match"), [
    ({"HETCCL_TIMEOUT": 0}, "HETCCL_TIMEOUT"),
    ({"timeout": "soon"}, "HETCCL_TIMEOUT"),
    ({"chunk_bytes": 100}, "HETCCL_CHUNK_BYTES"),
    ({"chunk_bytes": True}, "HETCCL_CHUNK_BYTES"),
    ({"HETCCL_PAIRLINK": 0}, "process-wide"),
    ({"speed": 1}, "not a hetccl setting"),
    (Settings(timeout=-1), "HETCCL_TIMEOUT"),
    (Settings(chunk_bytes=10), "HETCCL_CHUNK_BYTES"),
    ([("timeout", 1)], "a mapping"),
])
def test_settings_in_code_are_checked(settings: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings.build(settings)  # type: ignore[arg-type]


def test_bad_secret_in_code() -> None:
    with pytest.raises(ConfigError, match="secret"):
        Settings.build(secret=123)  # type: ignore[arg-type]


def test_init_takes_settings_and_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETCCL_SECRET", raising=False)
    comm = hetccl.init_sync(rank=0, world_size=1, settings={"HETCCL_TIMEOUT": 12, "chunk_bytes": "256K"},
                            secret="in-code")
    try:
        s = comm.async_comm.settings
        assert (s.timeout, s.chunk_bytes, s.secret) == (12.0, 256 << 10, b"in-code")
    finally:
        comm.close()
    with pytest.raises(ConfigError, match="HETCCL_TIMEOUT"):
        hetccl.init_sync(rank=0, world_size=1, settings={"timeout": -2})


def test_settings_in_effect() -> None:
    got = params.in_effect({"HETCCL_TIMEOUT": "9", "HETCCL_SECRET": "hush", "HETCCL_SHM_SLOTS": "1"})
    assert got["HETCCL_TIMEOUT"] == {"source": "environment", "value": 9.0}
    assert got["HETCCL_SECRET"] == {"source": "environment", "value": "(set)"}  # never printed
    assert "between 2 and 4096" in got["HETCCL_SHM_SLOTS"]["error"]
    assert got["HETCCL_CHUNK_BYTES"]["source"] == "default"
    assert "4M over TCP" in got["HETCCL_CHUNK_BYTES"]["value"]  # no fixed default: the transport's (shown)
    assert got["HETCCL_FLIGHT_RECORDS"]["source"] == "default"
    assert set(got) == set(params.TABLE)


def test_info_prints_the_settings_in_effect(capsys: pytest.CaptureFixture[str]) -> None:
    from hetccl import info

    info.print_settings(params.in_effect({"HETCCL_TIMEOUT": "9", "HETCCL_PAIRLINK": "perhaps"}))
    out = capsys.readouterr().out
    assert "settings in effect:" in out and "HETCCL_TIMEOUT" in out and "9.0" in out
    assert "HETCCL_PAIRLINK" in out and "refused" in out
    info.print_settings(params.in_effect({}))
    assert "all at their defaults" in capsys.readouterr().out


def test_a_forked_child_reads_its_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("HETCCL_FLIGHT_RECORDS", "5")
    assert params.get("HETCCL_FLIGHT_RECORDS") == 5
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.environ["HETCCL_FLIGHT_RECORDS"] = "6"
        os.write(w, str(params.get("HETCCL_FLIGHT_RECORDS")).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 16) == b"6"
    os.close(r)


def test_an_unknown_variable_is_named_once_with_the_closest_setting(monkeypatch, caplog) -> None:
    """A misspelt setting would do nothing in silence: init warns once per name, naming the closest one."""
    import asyncio
    import logging

    import hetccl

    monkeypatch.setenv("HETCCL_TIMEOUTT", "5")
    monkeypatch.setenv("HETCCL_ZZZQQQ", "1")
    monkeypatch.setattr(params, "_warned", set())
    monkeypatch.delenv("HETCCL_ADDR", raising=False)

    async def twice() -> None:
        for _ in range(2):
            comm = await hetccl.init(rank=0, world_size=1)
            await comm.close()

    with caplog.at_level(logging.WARNING, logger="hetccl"):
        asyncio.run(twice())
    said = [r.getMessage() for r in caplog.records if "is not a hetccl setting" in r.getMessage()
            and ("HETCCL_TIMEOUTT" in r.getMessage() or "HETCCL_ZZZQQQ" in r.getMessage())]  # CI sets others
    assert len(said) == 2, said
    assert "HETCCL_TIMEOUTT" in said[0] and "did you mean HETCCL_TIMEOUT?" in said[0], said
    assert "HETCCL_ZZZQQQ" in said[1] and "did you mean" not in said[1], said
    assert params.unknown({"HETCCL_RANK": "0", "HETCCL_TIMEOUT": "5"}, ["HETCCL_RANK"]) == []
