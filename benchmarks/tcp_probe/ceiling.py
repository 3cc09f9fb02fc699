import os
import socket
import sys
import threading
import time

N = 32 << 20
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
BUF = int(sys.argv[2]) if len(sys.argv) > 2 else 0
MODE = sys.argv[3] if len(sys.argv) > 3 else "duplex"


def tune(s):
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if BUF:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)


def run(s, who):
    tune(s)
    sb = bytearray(N)
    rb = bytearray(N)
    mv = memoryview(rb)
    times = []
    for _ in range(REPS):
        s.sendall(b"x")
        s.recv(1)
        t0 = time.perf_counter()
        if MODE == "duplex":
            th = threading.Thread(target=s.sendall, args=(sb,))
            th.start()
            got = 0
            while got < N:
                got += s.recv_into(mv[got:])
            th.join()
        else:  # half: send then recv (serial)
            if who == 0:
                s.sendall(sb)
                got = 0
                while got < N:
                    got += s.recv_into(mv[got:])
            else:
                got = 0
                while got < N:
                    got += s.recv_into(mv[got:])
                s.sendall(sb)
        times.append(time.perf_counter() - t0)
    times.sort()
    t = times[len(times) // 2]
    if who == 0:
        print(
            f"{MODE} buf={BUF} 32MiB each way: median {t * 1e3:.1f} ms -> per-direction {N / t / 1e9:.2f} GB/s, "
            f"an allreduce-64MiB-equivalent busbw(2 steps) ~ {2 * N / (2 * t) / 1e9:.2f} GB/s"
        )


ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(1)
port = ls.getsockname()[1]
pid = os.fork()
if pid == 0:
    c = socket.create_connection(("127.0.0.1", port))
    run(c, 1)
    os._exit(0)
a, _ = ls.accept()
run(a, 0)
os.waitpid(pid, 0)
