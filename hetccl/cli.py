"""Command line: `hetccl run`, `hetccl bench`, `hetccl info`, `hetccl topo`."""

from __future__ import annotations

import argparse
import sys


def _cmd_run(args: argparse.Namespace) -> int:
    from .launcher import launch

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("hetccl run: give the command to launch, e.g. hetccl run -n 2 -- python train.py", file=sys.stderr)
        return 2
    if args.nprocs < 1:
        print(f"hetccl run: -n {args.nprocs}: give the number of ranks to start, 1 or more "
              "(e.g. hetccl run -n 2 -- python train.py)", file=sys.stderr)
        return 2
    env = None
    if args.torch_backend_alias:
        import os
        from pathlib import Path

        # every rank loads hetccl/torch/alias/sitecustomize.py first: "nccl"/"gloo" requests become "hetccl"
        alias_dir = str(Path(__file__).resolve().parent / "torch" / "alias")
        path = os.environ.get("PYTHONPATH", "")
        env = {"HETCCL_TORCH_ALIAS": args.torch_backend_alias,
               "PYTHONPATH": alias_dir + (os.pathsep + path if path else "")}
    from .errors import HetcclError

    try:
        return launch(args.nprocs, cmd, env=env, addr=args.addr, port=args.port, timeout=args.timeout,
                      tag_output=not args.no_tag_output)
    except HetcclError as exc:  # bad flags (a ConfigError): one line, not a traceback
        print(f"hetccl run: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the program cannot be started (missing, not executable): as a shell says it
        print(f"hetccl run: cannot start {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


def _cmd_info(args: argparse.Namespace) -> int:
    if args.topo:
        return _cmd_topo(args)
    from .info import print_info

    return print_info()


def _cmd_topo(args: argparse.Namespace) -> int:
    from .topo import main as topo_main

    return topo_main(as_json=args.json)


def _cmd_bench(argv: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    p = argparse.ArgumentParser(prog="hetccl", description="hetccl: collectives across heterogeneous clusters")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="launch N local ranks (like torchrun --standalone)")
    r.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    r.add_argument("--addr", default="127.0.0.1", help="rendezvous address rank 0 listens on")
    r.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    r.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    r.add_argument("--no-tag-output", action="store_true",
                   help="do not prefix every output line with its rank ([1] ...), e.g. for JSON from one rank")
    r.add_argument("--torch-backend-alias", default=None, metavar="NAMES",
                   help="run an unmodified PyTorch script on hetccl: torch.distributed backends with these names "
                        "(comma list, e.g. nccl,gloo) become \"hetccl\"")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    r.set_defaults(func=_cmd_run)
    i = sub.add_parser("info", help="version, native build, transports and why any is unavailable")
    i.add_argument("--topo", action="store_true",
                   help="under a launcher: join the job and print its topology (same as `hetccl topo`)")
    i.add_argument("--json", action="store_true", help="with --topo: JSON instead of tables")
    i.set_defaults(func=_cmd_info)
    t = sub.add_parser("topo", help="under a launcher (hetccl run -n 3 -- hetccl topo): islands, hosts, ranks, "
                                    "transport and algorithm between each pair; printed by rank 0")
    t.add_argument("--json", action="store_true", help="JSON instead of tables")
    t.set_defaults(func=_cmd_topo)
    sub.add_parser("bench", help="nccl-tests style benchmark (hetccl bench --help)")
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
