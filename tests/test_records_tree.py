"""The bootstrap's records tree (hetccl/recordtree.py), in one process over real sockets on 127.0.0.1: its shape,
a push down it around an unreachable rank, and every push an inbox must refuse (a stranger, a rank that is not
above it, a frame over the bound, records of another world size) while it keeps waiting for the right one."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from hetccl.auth import client_handshake
from hetccl.errors import AuthenticationError
from hetccl.netio import send_all
from hetccl.recordtree import (
    PURPOSE,
    RECORDS_TREE_FANOUT,
    RECORDS_TREE_HOP_S,
    RecordsInbox,
    frame_bound,
    is_ancestor,
    push_records,
    records_frame,
    records_wait,
    tree_children,
)
from hetccl.wire import CONTROL_LEN

pytestmark = pytest.mark.timeout(30)

SECRET = b"job-secret-for-tests"
JOB = "0123456789abcdef"
HOST = "127.0.0.1"


def test_every_rank_but_0_has_one_parent_above_it() -> None:
    for size in (1, 2, 5, 6, 21, 100):
        parents = {c: r for r in range(size) for c in tree_children(r, size)}
        assert sorted(parents) == list(range(1, size))
        for c, p in parents.items():
            assert p == (c - 1) // RECORDS_TREE_FANOUT and is_ancestor(p, c) and is_ancestor(0, c)
            assert not is_ancestor(c, p) and not is_ancestor(c, c)
    assert list(tree_children(1, 8)) == [5, 6, 7]
    assert frame_bound(8192) == 16 << 20 and frame_bound(2) < 64 << 10
    # a rank waits a hop's budget per hop above it (4 hops at 85-340, with fan-out 4)
    assert [records_wait(r) / RECORDS_TREE_HOP_S for r in (0, 1, 4, 5, 20, 21, 84, 85, 255, 340, 341)] == [
        0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 5]


@pytest.fixture
async def inboxes() -> AsyncIterator[dict[int, RecordsInbox]]:
    made: dict[int, RecordsInbox] = {}
    yield made
    for inbox in made.values():
        await inbox.close()
        assert not inbox._tasks and inbox._sock is None  # nothing of it outlives close


def start(made: dict[int, RecordsInbox], rank: int, size: int, deaf: bool = False) -> list:
    inbox = made[rank] = RecordsInbox(rank, size, JOB, SECRET, HOST, 5.0, deaf=deaf)
    return list(inbox.start())


def records_of(size: int, addrs: dict[int, list]) -> list[dict]:
    return [{"pid": 1000 + r, **({"records_inbox": addrs[r]} if r in addrs else {})} for r in range(size)]


async def test_a_push_goes_around_an_unreachable_rank(inboxes: dict[int, RecordsInbox]) -> None:
    """6 ranks, rank 1 unreachable (bound, not listening): rank 0 reaches 1's child, 5, itself; then a rank that
    received the records forwards the same bytes to its children (here: none below 5)."""
    size = 6
    addrs = {r: start(inboxes, r, size, deaf=r == 1) for r in range(1, size)}
    records = records_of(size, addrs)
    frame = records_frame(records, size)
    delivered = await push_records(0, size, JOB, SECRET, frame, lambda r: records[r].get("records_inbox"), 5.0)
    assert sorted(delivered) == [2, 3, 4, 5]
    for r in (2, 3, 4, 5):
        assert await inboxes[r].wait(2.0) == records
        assert inboxes[r].frame == frame  # forwarded as it came
    assert await inboxes[1].wait(0.05) is None


async def test_an_inbox_refuses_what_is_not_its_ancestors_records(inboxes: dict[int, RecordsInbox]) -> None:
    size = 6
    host, port = start(inboxes, 5, size)  # its ancestors: 1 and 0
    inbox = inboxes[5]
    loop = asyncio.get_running_loop()

    async def dial(secret: bytes = SECRET, meta: dict | None = None) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        try:
            await client_handshake(loop, sock, secret, PURPOSE, meta or {"rank": 1, "job": JOB}, 5.0)
        except BaseException:
            sock.close()
            raise
        return sock

    async def refused_after(sock: socket.socket, parts: list[bytes], count: int) -> None:
        try:
            await send_all(loop, sock, parts)
        except Exception:  # noqa: BLE001 (the inbox may drop us before the end)
            pass
        finally:
            sock.close()
        for _ in range(200):
            if inbox.refused >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"refused {inbox.refused}, expected {count}")

    with pytest.raises(AuthenticationError):  # a stranger: wrong secret
        await dial(b"not the job secret")
    await refused_after(await dial(meta={"rank": 2, "job": JOB}), [], 2)  # rank 2 is not above 5
    await refused_after(await dial(meta={"rank": 1, "job": "another job"}), [], 3)
    over = frame_bound(size) + 1  # announced, never sent: refused before anything is read
    await refused_after(await dial(), [CONTROL_LEN.pack(over)], 4)
    await refused_after(await dial(), [records_frame(records_of(size - 1, {}), size)], 5)  # another world size
    assert await inbox.wait(0.05) is None

    good = records_of(size, {})
    sock = await dial()
    await send_all(loop, sock, [records_frame(good, size)])
    sock.close()
    assert await inbox.wait(2.0) == good
    assert inbox.refused == 5
