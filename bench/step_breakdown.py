"""Where a step's time goes: bench/throughput.py's workload on 1 attention + 2 expert ranks (or
--attention-ranks/--expert-ranks), split from the runtime's own per-layer counters (`llm.comm_stats()`, taken
before and after the timed run).

The attention rank's wall time splits into
- attention-side compute: embeddings, norms, QKV/O projections, paged attention, router, LM head;
- dispatch and combine: sending tokens to the experts and waiting for their results (this includes the expert
  ranks' FFN time, which the attention rank waits through);
- the rest: scheduling, building the batch metadata, sampling, the step header and reports, Python overhead.
The expert ranks' lines show how much of the same wall time each spent in its grouped FFN.
Prints the median of --repeats runs after a warm-up.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.throughput import workload  # noqa: E402
from launch import LLM, SamplingParams  # noqa: E402
from models import SHIPPED_MODEL  # noqa: E402


def _totals(stats: dict) -> dict[str, dict[str, float]]:
    """rank -> {"compute", "dispatch", "combine"} seconds summed over layers."""
    out = {}
    for r, rank in stats["ranks"].items():
        out[r] = {"role": rank["role"], "compute": sum(c["time_s"] for c in rank["compute"].values()),
                  "dispatch": sum(layer["dispatch"]["time_s"] for layer in rank["layers"].values()),
                  "combine": sum(layer["combine"]["time_s"] for layer in rank["layers"].values())}
    return out


def measure(llm: LLM, prompts, olens) -> dict:
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in olens]
    before, steps0 = _totals(llm.comm_stats()), llm.stats()["steps"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    after, steps1 = _totals(llm.comm_stats()), llm.stats()["steps"]
    n = sum(len(o.token_ids) for o in outs)
    per_rank = {r: {k: after[r][k] - before[r][k] for k in ("compute", "dispatch", "combine")} | {
        "role": after[r]["role"]} for r in after}
    return {"wall_s": wall, "steps": steps1 - steps0, "tokens": n, "ranks": per_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=2)
    ap.add_argument("--kernel-backend", default="auto", help="auto (sdpa on CPU), sdpa or torch (the references)")
    args = ap.parse_args()
    prompts, olens = workload(args.requests, model=args.model)
    A = args.attention_ranks
    with LLM(args.model, attention_ranks=A, expert_ranks=args.expert_ranks, max_num_seqs=64 // A,
             max_num_batched_tokens=512, micro_batches=args.micro_batches, threads_per_rank=args.threads_per_rank,
             kernel_backend=args.kernel_backend) as llm:
        measure(llm, prompts[:16], olens[:16])  # warm-up
        runs = [measure(llm, prompts, olens) for _ in range(args.repeats)]
    run = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # the median run, whole
    wall, steps = run["wall_s"], run["steps"]
    att = run["ranks"]["0"]
    rest = wall - att["compute"] - att["dispatch"] - att["combine"]
    rates = ", ".join(f"{r['tokens'] / r['wall_s']:.0f}" for r in runs)
    print(f"{run['tokens']} output tokens in {wall:.2f} s ({run['tokens'] / wall:.0f} tok/s; runs: {rates}), "
          f"{steps} steps, {1e3 * wall / steps:.2f} ms/step")
    print(f"{'attention rank 0':<44} {'s':>7} {'share':>6} {'ms/step':>8}")
    for name, t in [("attention-side compute (attn, router, head)", att["compute"]),
                    ("dispatch (send + wait)", att["dispatch"]), ("combine (wait + receive)", att["combine"]),
                    ("scheduler, batch, sampling, control, Python", rest)]:
        print(f"  {name:<42} {t:7.2f} {100 * t / wall:5.1f}% {1e3 * t / steps:8.2f}")
    for r, rank in sorted(run["ranks"].items(), key=lambda kv: int(kv[0])):
        if rank["role"] == "expert":
            print(f"  expert rank {r}: grouped FFN {rank['compute']:.2f} s ({100 * rank['compute'] / wall:.1f}% of "
                  f"the wall time, {1e3 * rank['compute'] / steps:.2f} ms/step)")


if __name__ == "__main__":
    main()
