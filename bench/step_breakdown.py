"""Where a step's time goes: bench/throughput.py's workload on 1 attention + 2 expert ranks (or
--attention-ranks/--expert-ranks), split from the runtime's own per-layer counters (`llm.comm_stats()`, taken
before and after the timed run).

The attention rank's wall time splits into
- attention-side compute: embeddings, norms, QKV/O projections, paged attention, router, LM head;
- dispatch and combine: sending tokens to the experts and waiting for their results (this includes the expert
  ranks' FFN time, which the attention rank waits through);
- forward, untimed: the model's forward time (comm_stats' "steps" forward_s) that the three timers above do not
  cover (the balancer's replica choice, switching between micro-batches);
- host work in steps: the rest of the rank's step time (comm_stats' "steps": on the leader from choosing a step's
  work to handing its outputs over) outside the forward: scheduling, the batch metadata, sampling, the step
  header and reports;
- outside steps: the rest of the wall time (taking requests in, start and end of the generate call).
The expert ranks' lines show how much of the same wall time each spent in its grouped FFN.
Prints the median of --repeats runs after a warm-up.

--decode-batch N (e.g. 64) replaces the workload with N requests of 16 prompt tokens and 256 output tokens, all in
flight at once: after two prefill steps every step decodes N sequences, so "host work in steps" is that of an
N-sequence decode step.
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
        steps = rank.get("steps", {})
        out[r] = {"role": rank["role"], "steps": steps.get("time_s", 0.0), "forward": steps.get("forward_s", 0.0),
                  "compute": sum(c["time_s"] for c in rank["compute"].values()),
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
    per_rank = {r: {k: after[r][k] - before[r][k] for k in ("steps", "forward", "compute", "dispatch", "combine")} | {
        "role": after[r]["role"]} for r in after}
    return {"wall_s": wall, "steps": steps1 - steps0, "tokens": n, "ranks": per_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=0, help="micro_batches (default 0: the engine's auto)")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=2)
    ap.add_argument("--kernel-backend", default="auto", help="auto (cpu where it builds, else sdpa), sdpa or torch")
    ap.add_argument("--decode-batch", type=int, default=0,
                    help="N > 0: N requests of 16 prompt and 256 output tokens in place of the workload")
    ap.add_argument("--smoke", action="store_true", help="16 requests of at most 32 output tokens, one run: " +
                    "a quick run that checks the bench works (tests run it; its figures mean little)")
    args = ap.parse_args()
    max_output = 256
    if args.smoke:
        args.requests, args.repeats, max_output = 16, 1, 32
    prompts, olens = workload(args.requests, max_output=max_output, model=args.model)
    if args.decode_batch > 0:
        if args.decode_batch > min(64, len(prompts)):
            ap.error(f"--decode-batch {args.decode_batch}: at most {min(64, len(prompts))} (64 in flight)")
        prompts, olens = [p[:16] for p in prompts[:args.decode_batch]], [256] * args.decode_batch
    A = args.attention_ranks
    with LLM(args.model, attention_ranks=A, expert_ranks=args.expert_ranks, max_num_seqs=64 // A,
             max_num_batched_tokens=512, micro_batches=args.micro_batches, threads_per_rank=args.threads_per_rank,
             kernel_backend=args.kernel_backend) as llm:
        measure(llm, prompts[:16], olens[:16])  # warm-up
        runs = [measure(llm, prompts, olens) for _ in range(args.repeats)]
        ran = llm.stats()["micro_batches"]
    run = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # the median run, whole
    wall, steps = run["wall_s"], run["steps"]
    att = run["ranks"]["0"]
    host = att["steps"] - att["forward"]
    glue = att["forward"] - att["compute"] - att["dispatch"] - att["combine"]
    outside = wall - att["steps"]
    rates = ", ".join(f"{r['tokens'] / r['wall_s']:.0f}" for r in runs)
    print(f"{run['tokens']} output tokens in {wall:.2f} s ({run['tokens'] / wall:.0f} tok/s; runs: {rates}), "
          f"{steps} steps, {1e3 * wall / steps:.2f} ms/step; {A}+{args.expert_ranks} ranks, micro_batches "
          f"{args.micro_batches} (the leader's count: {ran})")
    print(f"{'attention rank 0':<50} {'s':>7} {'share':>6} {'ms/step':>8}")
    for name, t in [("attention-side compute (attn, router, head)", att["compute"]),
                    ("dispatch (send + wait)", att["dispatch"]), ("combine (wait + receive)", att["combine"]),
                    ("forward, untimed (balancer, micro-batch switch)", glue),
                    ("host work in steps: scheduler, batch, sampling", host), ("outside steps", outside)]:
        print(f"  {name:<48} {t:7.2f} {100 * t / wall:5.1f}% {1e3 * t / steps:8.2f}")
    print(f"  host work per step: {1e3 * host / steps:.2f} ms of a {1e3 * att['steps'] / steps:.2f} ms step "
          f"({100 * host / att['steps']:.1f}%; header, reports and Python included)")
    for r, rank in sorted(run["ranks"].items(), key=lambda kv: int(kv[0])):
        if rank["role"] == "expert":
            print(f"  expert rank {r}: grouped FFN {rank['compute']:.2f} s ({100 * rank['compute'] / wall:.1f}% of "
                  f"the wall time, {1e3 * rank['compute'] / steps:.2f} ms/step)")


if __name__ == "__main__":
    main()
