"""Instrumented 64 MiB np2 all_reduce over TCP: time in recv_into / sendmsg / reduce / rest, bytes per recv."""

import collections
import os
import socket
import statistics
import time

import hetccl
import hetccl.scheduler as sch
import numpy as np
from hetccl import native

ST = collections.defaultdict(float)
CNT = collections.Counter()
RSIZES = []
SSIZES = []
ON = [False]
_orig_recv_into = socket.socket.recv_into
_orig_sendmsg = socket.socket.sendmsg


def recv_into(self, buf, *a):
    t = time.perf_counter()
    try:
        k = _orig_recv_into(self, buf, *a)
    except BlockingIOError:
        if ON[0]:
            ST["recv_eagain"] += time.perf_counter() - t
            CNT["recv_eagain"] += 1
        raise
    if ON[0]:
        ST["recv"] += time.perf_counter() - t
        CNT["recv"] += 1
        RSIZES.append(k)
    return k


def sendmsg(self, bufs, *a):
    t = time.perf_counter()
    try:
        k = _orig_sendmsg(self, bufs, *a)
    except BlockingIOError:
        if ON[0]:
            ST["send_eagain"] += time.perf_counter() - t
            CNT["send_eagain"] += 1
        raise
    if ON[0]:
        ST["send"] += time.perf_counter() - t
        CNT["send"] += 1
        SSIZES.append(k)
    return k


socket.socket.recv_into = recv_into
socket.socket.sendmsg = sendmsg
_ri = native.reduce_into


def reduce_into(*a):
    t = time.perf_counter()
    _ri(*a)
    if ON[0]:
        ST["reduce"] += time.perf_counter() - t
        CNT["reduce"] += 1


native.reduce_into = reduce_into
sch._REDUCERS.clear()  # the reducers bound native.reduce_into at creation: make them again through the wrapper

NB = int(os.environ.get("NB", 64 << 20))
ITERS = int(os.environ.get("ITERS", 10))


async def main():
    comm = await hetccl.init()
    # log socket options of the data sockets
    x = np.ones(NB // 4, np.float32)
    for _ in range(3):
        await comm.all_reduce(x)
    walls = []
    ON[0] = True
    c0 = time.thread_time()
    r0 = os.times()
    for _ in range(ITERS):
        await comm.barrier()
        t = time.perf_counter()
        await comm.all_reduce(x)
        walls.append(time.perf_counter() - t)
    ON[0] = False
    cpu = time.thread_time() - c0
    r1 = os.times()
    tot = sum(walls)
    me = comm.rank

    def f(k):
        return f"{ST[k] * 1e3 / ITERS:8.2f} ms/iter ({100 * ST[k] / tot:5.1f}%) n={CNT[k] / ITERS:.0f}/iter"

    med = statistics.median(walls)
    rest = tot - ST["recv"] - ST["send"] - ST["reduce"] - ST["recv_eagain"] - ST["send_eagain"]
    rs = sorted(RSIZES)
    ss = sorted(SSIZES)
    q = lambda s, p: s[min(len(s) - 1, int(p * len(s)))] if s else 0
    lines = [
        f"rank {me}: wall median {med * 1e3:.1f} ms -> busbw {NB / med / 1e9:.3f} GB/s; "
        f"sum {tot * 1e3 / ITERS:.1f} ms/iter; loop-thread CPU {cpu * 1e3 / ITERS:.1f} ms/iter "
        f"(user {(r1.user - r0.user) * 1e3 / ITERS:.1f} sys {(r1.system - r0.system) * 1e3 / ITERS:.1f})",
        f"  recv_into  {f('recv')}  bytes/call p10/50/90 {q(rs, 0.1)}/{q(rs, 0.5)}/{q(rs, 0.9)} "
        f"mean {sum(rs) / max(1, len(rs)):.0f}",
        f"  recv EAGAIN{f('recv_eagain')}",
        f"  sendmsg    {f('send')}  bytes/call p10/50/90 {q(ss, 0.1)}/{q(ss, 0.5)}/{q(ss, 0.9)} "
        f"mean {sum(ss) / max(1, len(ss)):.0f}",
        f"  send EAGAIN{f('send_eagain')}",
        f"  reduce     {f('reduce')}",
        f"  rest (python+loop+idle) {rest * 1e3 / ITERS:.2f} ms/iter; "
        f"idle (wall - thread CPU) {(tot - cpu) * 1e3 / ITERS:.2f} ms/iter",
    ]
    os.write(1, ("\n".join(lines) + "\n").encode())
    await comm.close()


hetccl.run(main())
