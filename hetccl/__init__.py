"""hetccl: one collective-communication library across GPUs of different vendors and CPU hosts.

    import hetccl
    comm = await hetccl.init()          # rank/size from hetccl run, torchrun, Slurm or Open MPI
    await comm.all_reduce(buf)          # numpy arrays, torch tensors, any buffer

`init_sync()` gives the same methods as plain blocking calls for code without an event loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Mapping
from typing import Any

from . import lifecycle, params
from .communicator import Communicator
from .config import RANK_VARIABLES, Identity, Settings, identity_from_env, parse_addr
from .dtypes import DType, ReduceOp
from .errors import (
    AuthenticationError,
    CollectiveMismatchError,
    CollectiveTimeout,
    CommAbortedError,
    ConfigError,
    HetcclError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from .sync import SyncCommunicator

__version__ = "0.1.0"


async def init(rank: int | None = None, world_size: int | None = None, addr: str | None = None,
               timeout: float | None = None, local_rank: int | None = None, *,
               settings: Settings | Mapping[str, Any] | None = None, secret: str | bytes | None = None
               ) -> Communicator:
    """Join the job and return the world communicator.

    With no arguments everything comes from the environment (HETCCL_*, torchrun, Slurm, Open MPI; see
    README). Arguments override the environment: `addr` is the rendezvous "host:port" that rank 0 serves.
    `settings` is a `Settings` (used as given) or a mapping of parameter names ("HETCCL_TIMEOUT" or
    "timeout", see hetccl/params.py) to values, laid over the environment's; `secret` is the job secret
    (HETCCL_SECRET). Both are checked as the environment's values are.
    """
    params.warn_unknown(RANK_VARIABLES)
    if rank is None and world_size is None:
        ident = identity_from_env()
        if addr is not None:
            # an explicit address: rank 0 serves there
            ident.addr, ident.meet = parse_addr(addr, name="addr" if ident.world_size > 1 else None), None
    else:
        if rank is None or world_size is None:
            raise ConfigError("pass both rank= and world_size= (or neither, to read the environment)")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} is outside 0..{world_size - 1}")
        if addr is None and world_size > 1:
            if "HETCCL_ADDR" not in os.environ:
                raise ConfigError("pass addr='host:port' (rank 0 serves the rendezvous there) or set HETCCL_ADDR")
            addr = os.environ["HETCCL_ADDR"]
        name = ("addr" if "HETCCL_ADDR" not in os.environ or addr != os.environ["HETCCL_ADDR"] else "HETCCL_ADDR")
        ident = Identity(rank, world_size, rank if local_rank is None else local_rank,
                         parse_addr(addr, name=name if world_size > 1 else None) if addr else None, "arguments")
    settings = Settings.build(settings, secret=secret, timeout=timeout)
    from .bootstrap import Fabric

    fabric = await Fabric.create(ident, settings)
    comm = Communicator(fabric, 1, list(range(ident.world_size)))
    comm._fabric_owner = True
    lifecycle.track_async(comm, asyncio.get_running_loop())  # closed at exit if the program does not
    if comm._islands > 1:  # heterogeneous job: island and leader sub-communicators, built collectively now
        from . import hierarchical

        await hierarchical.build_layout(comm)
    if fabric.store is not None:  # the store's host keeps no socket per rank; a later request connects again
        fabric.store.idle()
    return comm


def init_sync(**kwargs: Any) -> SyncCommunicator:
    """Blocking facade: same arguments as init(); collectives run on a background event loop."""
    return SyncCommunicator.create(init, **kwargs)


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop (hetccl's transports are fastest there): hetccl.run(main()).

    Communicators from init() that main leaves open (it returns, raises or calls sys.exit) are closed before
    the loop ends, with the closing barrier bounded by lifecycle.EXIT_WAIT_S."""

    async def guarded() -> Any:
        try:
            return await main
        except BaseException as exc:
            lifecycle.note_leaving(exc)  # the goodbye tells the peers this rank failed
            raise
        finally:
            await lifecycle.close_loop(asyncio.get_running_loop())

    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(guarded())
    return uvloop.run(guarded())


__all__ = [
    "CommAbortedError",
    "init", "init_sync", "run", "Communicator", "SyncCommunicator", "ReduceOp", "DType",
    "HetcclError", "CollectiveTimeout", "PeerLostError", "CollectiveMismatchError", "AuthenticationError",
    "ConfigError", "TransportError", "ProtocolError", "__version__",
]
