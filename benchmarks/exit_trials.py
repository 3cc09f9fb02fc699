"""Repeat init-then-exit jobs without close (tests/exit_workers.py) and count crashes, hangs and wrong exit codes.

    python benchmarks/exit_trials.py --runs 50 [--api torch,sync,async] [--how return,exit3,raise]

Every job is 2 real rank processes started directly, so every rank's exit code is seen. Prints one line per
(api, how) and a markdown table; exits 1 if any job crashed, hung or exited with the wrong code.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from exit_workers import APIS, CRASH_RCS, EXPECTED_RC, HOWS, run_job  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50, help="jobs per (api, how)")
    ap.add_argument("--api", default=",".join(APIS))
    ap.add_argument("--how", default="return,exit3,raise")
    ap.add_argument("--timeout", type=float, default=90.0, help="per job; a job still running is a hang")
    args = ap.parse_args()
    rows = []
    bad = 0
    for api in args.api.split(","):
        for how in args.how.split(","):
            assert api in APIS and how in HOWS, (api, how)
            tally: Counter[str] = Counter()
            worst = 0.0
            t0 = time.monotonic()
            for _ in range(args.runs):
                res = run_job(api, how, timeout=args.timeout)
                kinds = set()
                for rc in res.rcs:
                    if rc is None:
                        kinds.add("hang")
                    elif rc in CRASH_RCS:
                        kinds.add("crash")
                    elif rc != EXPECTED_RC[how]:
                        kinds.add("wrong rc")
                tally.update(kinds or {"clean"})
                worst = max([worst] + [s for s in res.exit_s if s is not None])
                if kinds:
                    print(f"  {api}/{how}: {sorted(kinds)} rcs={res.rcs}", flush=True)
            bad += args.runs - tally["clean"]
            rows.append((api, how, args.runs, tally["clean"], tally["crash"], tally["hang"], tally["wrong rc"],
                         worst, time.monotonic() - t0))
            print(f"{api}/{how}: {rows[-1][3:7]} of {args.runs}", flush=True)
    print("\n| api | ending | jobs | clean | crashed | hung | wrong code | slowest exit (s) | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]} | {r[7]:.2f} | {r[8]:.0f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
