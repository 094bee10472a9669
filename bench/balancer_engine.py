"""What a replica policy costs or gains in the engine: offline output tok/s of each --balancers policy against
`static` (the first replica, no plan, no counts exchange) on the same placement and workload, in the same run.

The engine: `LLM` with --split A+E ranks and --redundant-experts slots (EPLB's start-up placement of an unknown
load, as a launch makes it), the shipped model by default. Workload: bench/throughput.py's (64 requests, outputs
of at most 128 tokens, every request in flight at once). Per round and policy an engine starts, warms up on 16
requests and runs the workload --repeats times (the median counts); odd rounds run the policies in the given
order, even rounds in reverse (A B, B A, ...), so a steady drift of the machine's speed favours none. Printed per round each policy's tok/s and its ratio to static's in that
round, then the median ratio over the rounds; with --breakdown also the attention rank's forward seconds and each
expert rank's FFN seconds (comm_stats), the where of a difference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peers import parse_splits
from bench.throughput import run_ours, workload
from launch import LLM
from models import SHIPPED_MODEL


def measure(model: str, balancer: str, split: tuple[int, int], redundant: int, prompts, olens, repeats: int
            ) -> tuple[float, dict]:
    """Median tok/s of `repeats` runs on a fresh engine, and the ranks' busy seconds (warm-up included)."""
    a, e = split
    with LLM(model, attention_ranks=a, expert_ranks=e, max_num_seqs=max(1, len(prompts) // a),
             max_num_batched_tokens=512, balancer=balancer, redundant_experts=redundant) as llm:
        run_ours(llm, prompts[:16], olens[:16])
        rates = []
        for _ in range(repeats):
            dt, n = run_ours(llm, prompts, olens)
            rates.append(n / dt)
        stats = llm.comm_stats()
    busy = {}
    for rank, d in stats["ranks"].items():
        if d["role"] == "attention":
            busy[f"attention {rank} forward s"] = d["steps"]["forward_s"]
        else:
            busy[f"expert {rank} FFN s"] = sum(v["time_s"] for v in d.get("compute", {}).values())
    return statistics.median(rates), busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL, help="HF checkpoint directory (default: the shipped model)")
    ap.add_argument("--split", default="1+2", help="attention+expert ranks (default 1+2)")
    ap.add_argument("--redundant-experts", type=int, default=4, help="redundant expert slots (default 4)")
    ap.add_argument("--balancers", nargs="+", default=["least_loaded"], help="policies to set against static")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine (the median counts)")
    ap.add_argument("--breakdown", action="store_true", help="also print the ranks' busy seconds")
    ap.add_argument("--smoke", action="store_true", help="8 requests of at most 16 tokens, two rounds of one run")
    args = ap.parse_args()
    try:
        (split,) = parse_splits(args.split)
    except ValueError as e:
        ap.error(str(e).replace("--splits", "--split"))
    if args.smoke:
        args.requests, args.rounds, args.repeats = 8, 2, 1
    prompts, olens = workload(args.requests, max_output=16 if args.smoke else 128, model=args.model)
    policies = list(dict.fromkeys(["static", *args.balancers]))
    print(f"{args.requests} requests, {sum(olens)} output tokens; {split[0]}+{split[1]} ranks, "
          f"{args.redundant_experts} redundant expert slots; median of {args.repeats} runs per engine")
    ratios = {b: [] for b in policies[1:]}
    for r in range(args.rounds):
        got = {b: measure(args.model, b, split, args.redundant_experts, prompts, olens, args.repeats)
               for b in (policies if r % 2 == 0 else policies[::-1])}
        rates = {b: rate for b, (rate, _) in got.items()}
        for b in policies:
            busy = got[b][1]
            extra = "" if not args.breakdown else "  (" + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()) + ")"
            vs = "" if b == "static" else f", {rates[b] / rates['static']:.2f}x static"
            print(f"round {r + 1}: {b:>12s}: {rates[b]:.0f} tok/s{vs}{extra}", flush=True)
        for b in policies[1:]:
            ratios[b].append(rates[b] / rates["static"])
    for b, xs in ratios.items():
        print(f"{b} against static: {statistics.median(xs):.2f}x (median over {len(xs)} rounds: "
              f"{', '.join(f'{x:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
