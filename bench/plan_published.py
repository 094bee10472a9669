"""A published deployment beside the planner's hardware model: DeepSeek-V3's decode unit on H800s.

DeepSeek's inference-system overview (deepseek-ai/open-infra-index, 202502OpenSourceWeek, day 6) gives:
- decode: routed experts EP144 with 32 redundant experts, MLA and the shared expert DP144 (a unit of 18 nodes of
  8 H800s, 2 routed experts and the shared expert per GPU), dual micro-batch overlap;
- FP8 matmuls and dispatch, BF16 MLA and combine;
- over 24 hours: 20-22 output tokens/s per request, a mean KV length of 4,989 per output token, and ~14.8k output
  tokens/s per H800 node while decoding (1,850 per GPU).
Step-3's report (arXiv 2507.19427) puts DeepSeek-V3 at 2,324 tokens/s per GPU at 4K context under a 50 ms TPOT
(FP8, no MTP).

This prints those figures beside the model's (launch/plan/hardware.py, predictions): the same colocated
deployment (hardware.colocated_decode) at each setting, and the planner's best attention/FFN-disaggregated plan
on the same 144 GPUs (decode only, launch.plan's search), and writes them as JSON.

    python bench/plan_published.py --out plan_published.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.plan.__main__ import candidates, search, workload   # noqa: E402
from launch.plan.hardware import (HARDWARE, colocated_decode, count_params, derive_costs,  # noqa: E402
                                  memory_limits, model_config)

GPUS, REDUNDANT, CONTEXT = 144, 32, 4989
PUBLISHED = [   # (setting, context, TPOT s, kv bytes, tok/s per GPU, source)
    ("DeepSeek's online service, 24-hour mean", CONTEXT, 1 / 21, 2, 14800 / 8,
     "open-infra-index day 6: ~14.8k tok/s per node, 20-22 tok/s per request"),
    ("Step-3's report, DeepSeek-V3 at 4K", 4096, 0.050, 2, 2324, "arXiv 2507.19427: 50 ms TPOT, FP8, no MTP"),
]


def af_best(counts, hw, context: int, tpot_s: float, kv_bytes: float, requests: int, concurrency: list[int],
            ranks: int) -> dict:
    """The planner's best AF plan on `ranks` GPUs: decode only at `context` tokens, 64 output tokens each."""
    costs = derive_costs(counts, hw, 1.0, kv_bytes, True)
    min_experts, max_seqs = memory_limits(counts, hw, 1.0, kv_bytes, context + 64)
    prompts, outputs = workload(requests, (context, context), (64, 64), "uniform")
    plans = candidates(ranks, [1, 2], concurrency, min_experts, max_seqs)
    rows = search(costs, plans, prompts, outputs, tpot_s * 1e3, decode_only=True)
    best = rows[0]
    return {key: best[key] for key in ("plan", "max_num_seqs", "tok_s", "tpot_p99_ms", "attention_util",
                                       "expert_util", "meets_slo")} | {"tok_s_per_gpu": best["tok_s"] / ranks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows here (JSON)")
    ap.add_argument("--requests", type=int, default=8192, help="requests per AF simulation")
    ap.add_argument("--concurrency", default="2048,4096,6144,8192", help="AF: requests in flight to search")
    ap.add_argument("--ranks", type=int, default=GPUS, help="GPUs (the published unit: 144)")
    args = ap.parse_args(argv)
    counts, hw = count_params(model_config("deepseek-v3")), HARDWARE["h800"]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for setting, context, tpot_s, kv_bytes, published, source in PUBLISHED:
        t0 = time.perf_counter()
        colo = colocated_decode(counts, hw, args.ranks, context, tpot_s, 2, REDUNDANT, 1.0, kv_bytes)
        af = af_best(counts, hw, context, tpot_s, kv_bytes, args.requests, concurrency, args.ranks)
        rows.append({"setting": setting, "context": context, "tpot_ms": tpot_s * 1e3, "kv_bytes": kv_bytes,
                     "published_tok_s_per_gpu": published, "source": source, "colocated": colo, "af_best": af,
                     "seconds": time.perf_counter() - t0})
    print(f"DeepSeek-V3 on {args.ranks} H800s, decode; the model's figures are predictions (launch/plan/hardware.py)")
    print(f"{'setting':<42} {'published':>9} {'colocated model':>16} {'ratio':>6} {'AF best (model)':>16} {'ratio':>6}")
    for r in rows:
        colo, af, pub = r["colocated"], r["af_best"], r["published_tok_s_per_gpu"]
        print(f"{r['setting']:<42} {pub:9.0f} {colo['tok_s_per_gpu']:16.0f} {colo['tok_s_per_gpu'] / pub:5.2f}x "
              f"{af['tok_s_per_gpu']:16.0f} {af['tok_s_per_gpu'] / pub:5.2f}x")
        print(f"  colocated: {colo['seqs_per_gpu']} seqs/GPU ({colo['bound']}-bound, memory allows "
              f"{colo['memory_seqs']}), step {colo['step_ms']:.1f} ms; AF: {af['plan']}, {af['max_num_seqs']} "
              f"seqs per attention rank, TPOT p99 {af['tpot_p99_ms']:.1f} ms, utilisation "
              f"{af['attention_util']:.2f}/{af['expert_util']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpus": args.ranks, "redundant_experts": REDUNDANT, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
