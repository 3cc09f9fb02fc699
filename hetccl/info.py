"""`hetccl info`: version, native build, transports found and why any is unavailable."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import textwrap


def collect() -> dict[str, object]:
    import hetccl

    from .config import usable_cpus
    from .transports import registry
    from .transports.base import TRANSPORT_API_VERSION

    out: dict[str, object] = {
        "hetccl": hetccl.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": usable_cpus(),
        "transport_api": TRANSPORT_API_VERSION,
    }
    try:
        from .native import build_info

        out["native"] = build_info()
    except Exception as exc:  # the point of `info` is to say what is broken
        out["native"] = f"UNAVAILABLE: {exc}"
    try:
        import uvloop

        out["uvloop"] = uvloop.__version__
    except ImportError:
        out["uvloop"] = "not installed (asyncio's default loop is used)"
    transports = {}
    specs = registry.discover()
    for name, reason in registry.available().items():
        transports[name] = {"source": specs.get(name, "?"), "usable": reason is None, "reason": reason}
        try:  # what it declares (TransportProperties): what the cost model and the fabric go by
            transports[name]["properties"] = registry.load(name).properties.describe()
        except Exception:  # noqa: BLE001 - refused at load: the reason says why
            pass
    out["transports"] = transports
    links = {}
    try:
        for name, cls in registry.links().items():
            reason = cls.unavailable_reason()
            links[name] = {"usable": reason is None, "reason": reason, "properties": cls.properties.describe(),
                           "leaders": f"{cls.min_ranks}" + ("" if cls.max_ranks == cls.min_ranks else
                                                            f"-{cls.max_ranks or 'n'}")}
    except Exception as exc:  # noqa: BLE001 - the point of `info` is to say what is broken
        links["error"] = {"usable": False, "reason": str(exc), "properties": "", "leaders": ""}
    out["device_links"] = links
    from .config import island_label
    from .errors import ConfigError

    try:
        out["host"] = host_line()
    except ConfigError as exc:  # a bad HETCCL_HOST
        out["host"] = f"refused: {exc}"
    try:
        out["island"] = island_label()
    except ConfigError as exc:  # a bad HETCCL_ISLAND: say why, as for the rest
        out["island"] = f"refused: {exc}"
    vendors = {}
    from .bindings import ccl

    for name, loader in (("nccl", ccl.load_nccl), ("rccl", ccl.load_rccl)):
        try:
            lib = loader()
            vendors[name] = f"{'.'.join(map(str, lib.version))} at {lib.path}"
        except Exception as exc:  # the point of `info` is to say what is missing and why
            vendors[name] = f"unavailable: {' '.join(str(exc).split())}"
    out["vendor_ccl"] = vendors
    from . import params

    out["settings"] = params.in_effect()
    return out


def host_line() -> str:
    """This process's host identity (machine / boot id / network namespace [/ HETCCL_HOST name]): ranks with
    different ones never share memory."""
    from . import params
    from .bootstrap import host_identity
    from .config import env_local_rank, host_for

    names, local = params.get("HETCCL_HOST") or (), env_local_rank(os.environ)
    if len(names) > 1 and local is None:
        return f"{host_identity()}, and as HETCCL_HOST the entry of its local rank in {','.join(names)}"
    name = host_for(names, local)
    return host_identity(name) + (f" (HETCCL_HOST: acts as host {name!r})" if name else "")


def wrap(first: str, text: str, width: int | None = None) -> str:
    """``first`` + ``text`` wrapped at word boundaries to ``width`` columns (the terminal's, at least 60), the
    continuation lines indented under the start of ``text``. Nothing is cut."""
    if width is None:
        width = max(60, shutil.get_terminal_size((100, 24)).columns)
    indent = " " * len(first)
    return textwrap.fill(" ".join(str(text).split()), width=width, initial_indent=first, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def print_info() -> int:
    info = collect()
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key in ("transports", "device_links", "vendor_ccl", "settings"):
            continue
        print(wrap(f"{key:<{width}} : ", str(value)))
    print("transports:")
    for name, t in info["transports"].items():  # type: ignore[union-attr]
        state = "ok" if t["usable"] else f"unavailable: {t['reason']}"
        print(wrap(f"  {name:<8} ", f"{state}  ({t['source']})"))
        if t.get("properties"):
            print(wrap(f"  {'':<8} ", f"declares {t['properties']}"))
    print("device links (GPU island leaders of one host):")
    for name, t in info["device_links"].items():  # type: ignore[union-attr]
        state = "ok" if t["usable"] else f"unavailable: {t['reason']}"
        print(wrap(f"  {name:<8} ", f"{state}; {t['leaders']} leaders; declares {t['properties']}"))
    print("vendor collective libraries (GPU islands):")
    for name, state in info["vendor_ccl"].items():  # type: ignore[union-attr]
        print(wrap(f"  {name:<8} ", state))
    print_settings(info["settings"])  # type: ignore[arg-type]
    return 0


def print_settings(settings: dict[str, dict[str, object]]) -> None:
    """The HETCCL_* settings the environment sets (or refuses), from the parameter table (hetccl/params.py)."""
    chosen = {k: v for k, v in settings.items() if v["source"] == "environment" or "error" in v}
    print("settings in effect:" if chosen else "settings in effect: all at their defaults")
    width = max((len(k) for k in chosen), default=0)
    for name, v in chosen.items():
        print(wrap(f"  {name:<{width}} = ", f"refused: {v['error']}" if "error" in v else str(v["value"])))
    if chosen:
        print(f"  ({len(settings) - len(chosen)} more at their defaults: python -m hetccl.params lists them all)")
