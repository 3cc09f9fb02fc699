"""Joining a job started by torchrun, from its environment alone.

torchrun's agent hosts its own TCPStore at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), so
hetccl's rank 0 cannot serve its store there ("Address already in use"). Instead the ranks meet through
torchrun's store: rank 0 serves hetccl's store on a free port and publishes its address there (and, unless
HETCCL_SECRET is set, a job secret it draws, as the torch backend does: torchrun's store is exactly as trusted
as the job's own torch.distributed rendezvous); the other ranks read it there. Keys are named per torchrun run,
restart and init() call, so a restarted job or a second init() never reads an old address.

torch is imported only here, only under torchrun (where it is installed).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

from .errors import CollectiveTimeout, ConfigError
from .netio import route_source_addr
from .store import StoreServer
from .waits import WaitNotes

if TYPE_CHECKING:
    from .bootstrap import Fabric

_calls = itertools.count()  # init() calls of this process under torchrun: every rank makes them in one order


def _client(host: str, port: int, timeout: float) -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ConfigError(f"under torchrun hetccl meets through torchrun's store with torch.distributed, which "
                          f"does not import ({exc}); or set HETCCL_ADDR=host:port to a free port") from None
    try:  # a client like init_process_group's own; no world size: it must not count itself as a worker
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:
        raise CollectiveTimeout(f"cannot reach torchrun's store at {host}:{port} (MASTER_ADDR:MASTER_PORT) "
                                f"within {timeout:.0f} s: {exc}") from None


def _read(store: Any, key: str, rank: int, where: str, notes: WaitNotes, timeout: float) -> str:
    """Rank 0's entry, polled so that a long wait says so (a blocking get could not)."""
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise CollectiveTimeout(f"rank {rank}: waited {timeout:.0f} s for rank 0's hetccl store address in "
                                    f"torchrun's store at {where} (key {key!r}); did rank 0 call hetccl.init()?")
        notes.say(f"rank {rank} waiting for rank 0's store address in torchrun's store at {where}")
        time.sleep(0.02)
    return bytes(store.get(key)).decode()


async def meet(fab: Fabric) -> tuple[str, int]:
    """Start (rank 0) or find hetccl's store through torchrun's; -> its (host, port). Sets fab.server on rank 0
    and fab.settings.secret when rank 0 drew one."""
    s, rank = fab.settings, fab.rank
    assert fab.identity.addr is not None
    mhost, mport = fab.identity.addr
    if fab.size == 1:  # nobody to meet: a private store, not torchrun's port
        fab.server = StoreServer("127.0.0.1", 0, s.secret)
        return "127.0.0.1", await fab.server.start()
    env = os.environ
    key = (f"hetccl/init/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"{next(_calls)}")
    store = await asyncio.to_thread(_client, mhost, mport, s.timeout)
    if rank == 0:
        host = s.bind_addr or route_source_addr(mhost, mport)  # the address the other nodes reach us from
        drawn = ""
        if not s.secret:
            drawn = secrets.token_hex(32)
            s.secret = drawn.encode()
        fab.server = StoreServer(host, 0, s.secret)
        port = await fab.server.start()
        await asyncio.to_thread(store.set, key, f"{host} {port} {drawn}")
        return host, port
    value = await asyncio.to_thread(_read, store, key, rank, f"{mhost}:{mport}", WaitNotes(s), s.timeout)
    host, port_text, drawn = (value.split(" ") + [""])[:3]
    if drawn and not s.secret:
        s.secret = drawn.encode()
    return host, int(port_text)
