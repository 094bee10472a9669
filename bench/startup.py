"""Engine start-up: ranks forked from the fork server (launch/procs.py, rank_context) against fresh interpreters.

Each start method runs in a process of its own, which builds the shipped model's engine several times: the
first also starts the fork server; the later ones are what a process that builds engines again (a test
session, a job re-formed by hand) and a rank joining a running job see. The figure per engine is the time from
LLM(...) to the end of a first 4-token request. Prints the median of the later starts per method and size, and
the ratio of spawn's to the fork server's.

    python bench/startup.py [--repeats 5] [--out startup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = [(1, 1), (2, 2)]


def measure(sizes: list[tuple[int, int]], repeats: int) -> dict:
    """In this process: seconds from LLM(...) to a first request's end, per size, repeats + 1 times each."""
    from launch import LLM, SamplingParams
    from models import SHIPPED_MODEL
    out = {}
    for a, e in sizes:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with LLM(SHIPPED_MODEL, attention_ranks=a, expert_ranks=e, load_progress=False) as llm:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
                times.append(time.perf_counter() - t0)
        out[f"{a}+{e}"] = times
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="starts after the first, per size (default 5)")
    ap.add_argument("--smoke", action="store_true", help="one start after the first, 1+1 only")
    ap.add_argument("--out", help="write every start's seconds here (JSON)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = SIZES[:1] if args.smoke else SIZES
    repeats = 1 if args.smoke else args.repeats
    if args.child:
        print(json.dumps(measure(sizes, repeats)))
        return 0
    results = {}
    for method in ("forkserver", "spawn"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--repeats", str(repeats)]
        done = subprocess.run(cmd + (["--smoke"] if args.smoke else []), cwd=ROOT, capture_output=True, text=True,
                              timeout=900, env={**os.environ, "AFSERVE_START_METHOD": method})
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        results[method] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"engine start + first request, shipped model, {os.cpu_count()} CPUs, median of {repeats} later starts")
    print("| size | fork server: first | fork server: later | spawn: first | spawn: later | spawn / fork server |")
    print("|---|---|---|---|---|---|")
    for size in results["forkserver"]:
        fs, sp = results["forkserver"][size], results["spawn"][size]
        later_fs, later_sp = statistics.median(fs[1:]), statistics.median(sp[1:])
        print(f"| {size} | {fs[0]:.2f} s | {later_fs:.2f} s | {sp[0]:.2f} s | {later_sp:.2f} s | "
              f"{later_sp / later_fs:.1f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
