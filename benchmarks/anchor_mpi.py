#!/usr/bin/env python3
"""Open MPI anchor (mpi4py, buffer interface, numpy float32), measured the way `hetccl bench` measures
hetccl (see benchcommon.py). Adapted from the project's anchor script shared/anchors/mpi_allreduce.py.

Run it under mpirun; all traffic stays on this host:
  # shared memory (vader BTL, CMA single copy)
  mpirun --allow-run-as-root --oversubscribe -np 2 --mca oob_tcp_if_include lo \\
      --mca pml ob1 --mca btl vader,self  python benchmarks/anchor_mpi.py --transport sm
  # TCP over 127.0.0.1 (Open MPI leaves lo out by default, so it is included explicitly)
  mpirun --allow-run-as-root --oversubscribe -np 2 --mca oob_tcp_if_include lo \\
      --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo  python benchmarks/anchor_mpi.py --transport tcp

Ops (hetccl names): all_reduce = Allreduce(IN_PLACE), all_gather = Allgather, broadcast = Bcast(root 0),
reduce_scatter = Reduce_scatter_block, all_to_all = Alltoall. Every size's first call is checked.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchcommon as bc  # noqa: E402


def make_case(comm, op: str, size: int, align: int):
    rank, n = comm.Get_rank(), comm.Get_size()
    count = size // 4
    F = MPI.FLOAT
    full = bc.aligned_full
    if op == "all_reduce":
        buf = full(count, rank + 1, np.float32, align)
        want = n * (n + 1) / 2

        def run():
            comm.Allreduce(MPI.IN_PLACE, [buf, F], op=MPI.SUM)

        def check():
            return int(np.count_nonzero(buf != want))

        def after():
            buf.fill(0)  # in place: keep the values finite over many iterations
        return run, check, after, "ip", "Allreduce(IN_PLACE)"
    if op == "broadcast":
        buf = full(count, rank + 1, np.float32, align)

        def run():
            comm.Bcast([buf, F], root=0)

        def check():
            return int(np.count_nonzero(buf != 1.0))
        return run, check, None, "oop", "Bcast root 0"
    if count % n:
        return None
    per = count // n
    if op == "all_gather":
        inp = full(per, rank + 1, np.float32, align)
        out = full(count, 0, np.float32, align)
        want = np.repeat(np.arange(1, n + 1, dtype=np.float32), per)

        def run():
            comm.Allgather([inp, F], [out, F])

        def check():
            return int(np.count_nonzero(out != want))
        return run, check, None, "oop", "Allgather"
    if op == "reduce_scatter":
        inp = full(count, 0, np.float32, align)
        inp[:] = np.repeat((rank + 1) * np.arange(1, n + 1, dtype=np.float32), per)
        out = full(per, 0, np.float32, align)
        want = (rank + 1) * n * (n + 1) / 2

        def run():
            comm.Reduce_scatter_block([inp, F], [out, F], op=MPI.SUM)

        def check():
            return int(np.count_nonzero(out != want))
        return run, check, None, "oop", "Reduce_scatter_block"
    if op == "all_to_all":
        inp = full(count, 0, np.float32, align)
        inp[:] = np.repeat(rank * n + np.arange(n, dtype=np.float32), per)
        out = full(count, 0, np.float32, align)
        want = np.repeat(np.arange(n, dtype=np.float32) * n + rank, per)

        def run():
            comm.Alltoall([inp, F], [out, F])

        def check():
            return int(np.count_nonzero(out != want))
        return run, check, None, "oop", "Alltoall"
    raise ValueError("unknown op %r" % op)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(ap)
    ap.add_argument("--transport", default="", help="label (sm, tcp) for the output")
    ap.add_argument("--align", type=int, default=0,
                    help="align buffers to this many bytes (0 = numpy's default, like hetccl bench)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for op in ops:
        if op not in bc.OPS:
            if rank == 0:
                print("unknown op %r; choose from %s" % (op, ",".join(bc.OPS)), file=sys.stderr)
            return 2
    mca = " ".join("%s=%s" % (k[len("OMPI_MCA_"):], v) for k, v in sorted(os.environ.items())
                   if k.startswith("OMPI_MCA_") and not k.startswith(("OMPI_MCA_orte", "OMPI_MCA_ess",
                                                                      "OMPI_MCA_pmix"))
                   and k != "OMPI_MCA_initial_wdir")
    lib = MPI.Get_library_version().splitlines()[0].strip()
    if rank == 0:
        print("# mpi anchor: %s; mpi4py; %d ranks on %d cpus; transport %s; MCA env: %s" % (
            lib, n, os.cpu_count(), args.transport or "?", mca or "(defaults)"), flush=True)
    rows, total_wrong, impls = [], 0, {}
    wt = MPI.Wtime
    for op in ops:
        header_done = False
        for size in bc.sizes(args.minbytes, args.maxbytes, args.stepfactor):
            case = make_case(comm, op, size, args.align)
            if case is None:
                continue
            run, check, after, variant, impl = case
            impls[op] = impl
            if rank == 0 and not header_done:
                print(bc.header(op, n, "MPI_" + impl), flush=True)
                header_done = True
            comm.Barrier()
            run()
            wrong = comm.allreduce(check(), op=MPI.SUM)
            if after:
                after()
            for _ in range(args.warmup_iters):
                run()
            t0 = wt()
            comm.Barrier()
            run()
            est = comm.allreduce(wt() - t0, op=MPI.MAX)
            iters = bc.n_iters(est, args.iters, args.budget)
            times = np.zeros(iters, dtype=np.float64)
            for i in range(iters):
                comm.Barrier()
                t = wt()
                run()
                times[i] = wt() - t
            tmax = np.zeros_like(times)
            comm.Allreduce([times, MPI.DOUBLE], [tmax, MPI.DOUBLE], op=MPI.MAX)
            total_wrong += wrong
            if rank == 0:
                r = bc.row(op, n, size, iters, bc.median(tmax.tolist()), wrong, variant)
                rows.append(r)
                print(bc.row_line(r, variant), flush=True)
            del run, check, after, case
    if rank == 0:
        print("\n# Out of bounds values : %d %s" % (total_wrong, "OK" if total_wrong == 0 else "FAILED"),
              flush=True)
        import mpi4py

        bc.write_json(args.json, "mpi", n, rows, library=lib, mpi4py=mpi4py.__version__, impl=impls,
                      transport=args.transport, mca=mca, align=args.align)
    comm.Barrier()
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
