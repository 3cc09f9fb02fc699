"""Hierarchical all_gather, reduce_scatter, broadcast and reduce across islands (all_reduce: dispatch.py).

Each is written with three kinds of step: inside an island (the island sub-communicator, which runs the
vendor CCL on device memory and hetccl's host algorithms on host memory), among island leaders (the leaders'
sub-communicator, flat: staged through host memory for device buffers), and local copies. Every rank of the
communicator runs the same steps whatever memory it holds, so GPU islands and CPU islands mix.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import native
from ..dtypes import Buf, ReduceOp, as_buf, parse_op
from ..errors import ConfigError
from .buffers import as_device_buf, is_device
from .dispatch import Layout, check_device_label, layout
from .runtime import as_tensor, divide_inplace, stream_of, torch_mod, use_device

if TYPE_CHECKING:
    from ..communicator import Communicator


class _View:
    """A flat view of a user buffer that the sub-collectives accept: a torch tensor for device memory, a Buf
    (bytes + dtype) for host memory, with slicing and scratch of the same kind."""

    def __init__(self, comm: Communicator, lay: Layout, obj: Any, name: str):
        if is_device(obj):
            self.dev = True
            buf = as_device_buf(obj, name)
            check_device_label(comm, lay, buf)
            use_device(buf.device)
            self.flat = as_tensor(buf)
            # local steps (scratch, copies, division) run on the caller's stream, ordered with its work and with
            # the sub-collectives (which take that stream too), and scratch is allocated for that stream
            self.stream = stream_of(buf)
        else:
            self.dev = False
            self.flat = as_buf(obj, name, writable=False)
            self.stream = None

    def __len__(self) -> int:
        return int(self.flat.shape[0]) if self.dev else self.flat.count

    def local(self) -> Any:
        return torch_mod().cuda.stream(self.stream) if self.dev else contextlib.nullcontext()

    def empty(self, count: int) -> Any:
        if self.dev:
            with self.local():
                return torch_mod().empty(count, dtype=self.flat.dtype, device=self.flat.device)
        dt = self.flat.dtype
        return Buf(np.empty(count * dt.itemsize, np.uint8), dt, count)

    def copy(self, dst: Any, src: Any) -> None:
        with self.local():
            _copy(dst, src)

    def divide(self, x: Any, divisor: int) -> None:
        with self.local():
            _divide(x, divisor)


def _views(comm: Communicator, lay: Layout, out: Any, inp: Any) -> tuple[_View, _View]:
    vo, vi = _View(comm, lay, out, "out"), _View(comm, lay, inp, "inp")
    if vo.dev != vi.dev:
        raise ConfigError(f"out is {'device' if vo.dev else 'host'} memory but inp is "
                          f"{'device' if vi.dev else 'host'} memory; across islands pass both of one kind")
    return vo, vi


def _sl(x: Any, a: int, b: int) -> Any:
    if isinstance(x, Buf):
        isz = x.dtype.itemsize
        return Buf(x.data[a * isz: b * isz], x.dtype, b - a, x.obj)
    return x[a:b]


def _copy(dst: Any, src: Any) -> None:
    if isinstance(dst, Buf):
        dst.data[...] = src.data
    else:
        dst.copy_(src)


def _divide(x: Any, divisor: int) -> None:
    if isinstance(x, Buf):
        native.divide(x.data, x.dtype, divisor)
    else:
        divide_inplace(x, divisor)


async def broadcast(comm: Communicator, buf: Any, root: int) -> None:
    lay = await layout(comm)
    v = _View(comm, lay, buf, "buf")
    comm._fp(4, None, len(v), root)
    root_island = next(i for i, m in enumerate(lay.islands) if root in m)
    members, isl = lay.my_members, lay.island_comm
    mine = lay.mine == root_island
    root_leads = lay.islands[root_island][0] == root
    if isl is not None and mine and not root_leads:  # root's island first: its leader gets the data
        await isl.broadcast(buf, root=members.index(root))
    if lay.leaders is not None and comm.rank == members[0]:
        await lay.leaders.broadcast(buf, root=root_island, _flat=True)
    if isl is not None and not (mine and not root_leads):
        await isl.broadcast(buf, root=0)


async def reduce(comm: Communicator, buf: Any, root: int, op: Any) -> None:
    rop = parse_op(op)
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    lay = await layout(comm)
    v = _View(comm, lay, buf, "buf")
    comm._fp(5, None, len(v), root, rop)
    root_island = next(i for i, m in enumerate(lay.islands) if root in m)
    members, isl = lay.my_members, lay.island_comm
    leader = comm.rank == members[0]
    # leaders accumulate in a copy: only root's buffer may change
    acc = v.flat
    if leader:
        acc = v.empty(len(v))
        v.copy(acc, v.flat)
    if isl is not None:
        await isl.reduce(acc if leader else buf, root=0, op=inner)
    if lay.leaders is not None and leader:
        await lay.leaders.reduce(acc, root=root_island, op=inner, _flat=True)
    if lay.mine == root_island:
        if root == members[0]:
            v.copy(v.flat, acc)
        elif isl is not None:  # the island leader hands the result to root; others receive into scratch
            tmp = acc if leader else (v.flat if comm.rank == root else v.empty(len(v)))
            await isl.broadcast(tmp, root=0)
        if comm.rank == root and rop == ReduceOp.AVG:
            v.divide(v.flat, comm.size)


async def all_gather(comm: Communicator, out: Any, inp: Any) -> None:
    lay = await layout(comm)
    vo, vi = _views(comm, lay, out, inp)
    k = len(vi)
    if len(vo) != comm.size * k:
        raise ConfigError(f"all_gather: out has {len(vo)} elements, needs size*len(inp) = {comm.size * k}")
    comm._fp(2, None, k)
    members, isl = lay.my_members, lay.island_comm
    width = max(len(m) for m in lay.islands)
    mine = vi.empty(width * k)  # this island's blocks, padded to the largest island
    if isl is not None:
        await isl.all_gather(_sl(mine, 0, len(members) * k), vi.flat)
    else:
        vi.copy(_sl(mine, 0, k), vi.flat)
    every = vi.empty(len(lay.islands) * width * k)
    if lay.leaders is not None and comm.rank == members[0]:
        await lay.leaders.all_gather(every, mine, _flat=True)
    if isl is not None:
        await isl.broadcast(every, root=0)
    for i, island in enumerate(lay.islands):  # back to communicator rank order
        for j, r in enumerate(island):
            a = (i * width + j) * k
            vi.copy(_sl(vo.flat, r * k, (r + 1) * k), _sl(every, a, a + k))


async def reduce_scatter(comm: Communicator, out: Any, inp: Any, op: Any) -> None:
    rop = parse_op(op)
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    lay = await layout(comm)
    vo, vi = _views(comm, lay, out, inp)
    k = len(vo)
    if len(vi) != comm.size * k:
        raise ConfigError(f"reduce_scatter: inp has {len(vi)} elements, needs size*len(out) = {comm.size * k}")
    comm._fp(3, None, k, -1, rop)
    members, isl = lay.my_members, lay.island_comm
    acc = vi.empty(len(vi))
    vi.copy(acc, vi.flat)
    if isl is not None:
        await isl.reduce(acc, root=0, op=inner)
    if lay.leaders is not None and comm.rank == members[0]:
        await lay.leaders.all_reduce(acc, op=inner)
    if isl is not None:
        await isl.broadcast(acc, root=0)
    r = comm.rank
    vi.copy(vo.flat, _sl(acc, r * k, (r + 1) * k))
    if rop == ReduceOp.AVG:
        vi.divide(vo.flat, comm.size)
