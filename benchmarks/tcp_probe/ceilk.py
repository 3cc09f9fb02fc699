"""k sockets between two processes; each moves 32MiB/k both ways at once (a send thread and a recv thread per
socket, blocking). Prints the per-direction rate (= the np 2 all_reduce busbw equivalent)."""

import os
import socket
import sys
import threading
import time

N = 32 << 20
K = int(sys.argv[1])
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 15


def recv_all(s, mv):
    got = 0
    while got < len(mv):
        got += s.recv_into(mv[got:])


def run(socks, who):
    part = N // K
    sb = bytearray(N)
    rb = bytearray(N)
    mv = memoryview(rb)
    smv = memoryview(sb)
    times = []
    for _ in range(REPS):
        socks[0].sendall(b"x")
        socks[0].recv(1)
        t0 = time.perf_counter()
        ths = []
        for j, s in enumerate(socks):
            ths.append(threading.Thread(target=s.sendall, args=(smv[j * part : (j + 1) * part],)))
            ths.append(threading.Thread(target=recv_all, args=(s, mv[j * part : (j + 1) * part])))
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        times.append(time.perf_counter() - t0)
    times.sort()
    t = times[len(times) // 2]
    if who == 0:
        print(
            f"{K} socket(s), duplex, 32 MiB each way: median {t * 1e3:.1f} ms -> {N / t / 1e9:.2f} GB/s per direction",
            flush=True,
        )


ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(16)
port = ls.getsockname()[1]
pid = os.fork()
if pid == 0:
    cs = [socket.create_connection(("127.0.0.1", port)) for _ in range(K)]
    for c in cs:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    run(cs, 1)
    os._exit(0)
ss = [ls.accept()[0] for _ in range(K)]
for c in ss:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
run(ss, 0)
os.waitpid(pid, 0)
