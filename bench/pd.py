"""PD on AF against colocated attention ranks at the same rank count: TTFT and TPOT (p50, p99) and output
throughput of the OpenAI-compatible server on a mixed workload (a share of long prompts among short ones) and on
short prompts only (where PD is expected to lose), and the KV transfer's share of TTFT.

Servers side by side (launch/serve.py under torchrun on loopback, the shipped Shakespeare MoE or --model):
colocated, A attention + E expert ranks (--split, default 2+1), every attention rank prefilling and decoding; PD,
the same ranks with --prefill-ranks P (default 1), every rank one forward a step (max_decode_passes 1, the
default) and the KV streamed to the decode rank as the prefill's chunks complete (stream_kv, the default); pd_copy,
the same with --no-stream-kv (every block at the move: stop-and-copy); and, with --configs, pd_passes, the PD
server with --max-decode-passes 8 (decode ranks running up to 8 forwards a step while the prefill rank runs one),
which shows what the decode passes change. All with the same limits
(max-num-seqs 64, max-num-batched-tokens 512). Requests: bench/serve_load.py's client (streaming, greedy,
ignore_eos), token-id prompts from the held-out play. Mixed: a --long-share of prompts of 512-896 tokens, the rest
16-64; outputs 16-128 tokens, long-tailed (and within the model's 1024 positions). Short: prompts of 16-64 tokens.
Each workload runs at --concurrency (default 8) for --repeats rounds after a warm-up; a round sends it to each
server in turn (the order rotating every round, so the VM's drift falls on both alike), and the median run (by
throughput) is printed. TTFT: request sent -> first streamed chunk; TPOT: (last chunk - first) / (tokens - 1), per
request. The KV transfer's share of TTFT: the PD server's mean seconds per move (afserve_pd_kv_transfer_seconds, on
the decode rank, over the timed runs) over the median run's mean TTFT. The peer is the colocated server, measured
in the same run: the ratio columns are colocated / PD for latencies (higher is better for PD) and PD / colocated
for throughput."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from bench.peers import parse_splits
from bench.serve_load import run_level
from bench.throughput import workload
from launch.local_server import LocalServer
from models import SHIPPED_MODEL

LIMITS = ["--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--served-model-name", "bench"]
MAX_POSITIONS = 1024


def requests(n: int, long_share: float, seed: int, model: str) -> tuple[list[list[int]], list[int]]:
    """n prompts from the held-out play: a long_share of them 512-896 tokens, the rest 16-64; outputs 16-128
    tokens (long-tailed, within MAX_POSITIONS)."""
    g = torch.Generator().manual_seed(seed)
    base, _ = workload(n, seed, model=model)   # the play's tokens (prompts of 16-256 from random places)
    text = [t for p in base for t in p]
    prompts, olens = [], []
    for i in range(n):
        long = torch.rand(1, generator=g).item() < long_share
        length = int(torch.randint(512, 897, (1,), generator=g)) if long else int(torch.randint(16, 65, (1,),
                                                                                               generator=g))
        start = int(torch.randint(0, max(1, len(text) - length), (1,), generator=g))
        prompt = (text * (1 + length // max(1, len(text))))[start:start + length]
        prompts.append(prompt)
        out = 16 + int(112 * torch.rand(1, generator=g).item() ** 2)
        olens.append(min(out, MAX_POSITIONS - len(prompt)))
    return prompts, olens


SERIES = ("afserve_pd_kv_transfer_seconds_sum", "afserve_pd_kv_transfer_seconds_count",
          "afserve_pd_kv_blocks_transferred_total", "afserve_pd_kv_blocks_streamed_total")


def pd_transfer(url: str) -> dict[str, float]:
    """The server's move series so far: afserve_pd_kv_transfer_seconds (sum, count), and the KV blocks sent at
    the moves and streamed ahead of them."""
    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    values = dict.fromkeys(SERIES, 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in values:
            values[name] = float(value)
    return values


def run_workload(urls: dict[str, str], prompts, olens, concurrency: int, repeats: int) -> dict[str, dict]:
    names = list(urls)
    runs: dict[str, list] = {name: [] for name in urls}
    pd = [name for name in names if name.startswith("pd")]
    before = {name: pd_transfer(urls[name]) for name in pd}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(asyncio.run(run_level(urls[name], concurrency, prompts, olens)))
    out = {}
    for name in urls:
        ranked = sorted(runs[name], key=lambda x: x["tok_s"])
        out[name] = {**ranked[len(ranked) // 2], "runs": [x["tok_s"] for x in runs[name]]}
    for name in pd:
        after = pd_transfer(urls[name])
        delta = {k: after[k] - before[name][k] for k in SERIES}
        moves = delta["afserve_pd_kv_transfer_seconds_count"]
        per_move_ms = 1e3 * delta["afserve_pd_kv_transfer_seconds_sum"] / moves if moves else 0.0
        out[name]["kv_transfer_ms_per_move"] = per_move_ms
        out[name]["kv_transfer_share_of_ttft_p50"] = per_move_ms / out[name]["ttft_p50"] if out[name]["ttft_p50"] \
            else 0
        out[name]["kv_blocks_per_move"] = delta["afserve_pd_kv_blocks_transferred_total"] / moves if moves else 0.0
        out[name]["kv_blocks_streamed_per_move"] = \
            delta["afserve_pd_kv_blocks_streamed_total"] / moves if moves else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--split", default="2+1", help="attention+expert ranks of both servers (default 2+1)")
    ap.add_argument("--prefill-ranks", type=int, default=1, help="the PD server's prefill ranks (default 1)")
    ap.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    ap.add_argument("--long-share", type=float, default=0.25, help="share of long prompts in the mixed workload")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="runs per workload and server (default 3)")
    ap.add_argument("--configs", default="colocated,pd,pd_copy",
                    help="servers to compare (colocated always runs): pd (streamed KV, the default), pd_copy "
                         "(--no-stream-kv: every block at the move), pd_passes (--max-decode-passes 8)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="8 requests, one run: a quick run that checks the bench "
                    "works (its figures mean little)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.repeats = 8, 1
    try:
        (split,) = parse_splits(args.split)
    except ValueError as e:
        ap.error(str(e).replace("--splits", "--split"))
    if not 0 < args.prefill_ranks < split[0]:
        ap.error(f"--prefill-ranks {args.prefill_ranks} with {split[0]} attention ranks: pass 1 to {split[0] - 1}")
    base = ["--attention-ranks", str(split[0]), *LIMITS]
    pd = base + ["--prefill-ranks", str(args.prefill_ranks)]
    every = {"colocated": base, "pd": pd, "pd_copy": pd + ["--no-stream-kv"],
             "pd_passes": pd + ["--max-decode-passes", "8"]}
    unknown = [c for c in args.configs.split(",") if c not in every]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(every)}")
    configs = {c: every[c] for c in ["colocated"] + [c for c in args.configs.split(",") if c != "colocated"]}
    workloads = {"mixed": requests(args.requests, args.long_share, 0, args.model),
                 "short": requests(args.requests, 0.0, 1, args.model)}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(LocalServer(args.model, nproc=sum(split), args=a)).url
                for name, a in configs.items()}
        warm_p, warm_o = requests(8, args.long_share, 9, args.model)
        for url in urls.values():
            asyncio.run(run_level(url, args.concurrency, warm_p, warm_o))
        results = {w: run_workload(urls, p, o, args.concurrency, args.repeats) for w, (p, o) in workloads.items()}
    print(f"{'+'.join(map(str, split))} ranks, PD: {args.prefill_ranks} prefill + {split[0] - args.prefill_ranks} "
          f"decode; {args.requests} requests at concurrency {args.concurrency}; median of {args.repeats} run(s)")
    print("| workload | config | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s | "
          "TPOT p99 coloc/PD | tok/s PD/coloc | KV transfer ms/move | share of TTFT p50 | blocks/move: at the "
          "move, streamed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w, res in results.items():
        c = res["colocated"]
        for name in configs:
            r = res[name]
            extra = (f"{c['tpot_p99'] / r['tpot_p99']:.2f}x | {r['tok_s'] / c['tok_s']:.2f}x | "
                     f"{r['kv_transfer_ms_per_move']:.2f} | {100 * r['kv_transfer_share_of_ttft_p50']:.1f}% | "
                     f"{r['kv_blocks_per_move']:.1f}, {r['kv_blocks_streamed_per_move']:.1f}"
                     if name.startswith("pd") else "1.00x | 1.00x | - | - | -")
            print(f"| {w} | {name} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['tpot_p50']:.2f} | "
                  f"{r['tpot_p99']:.2f} | {r['tok_s']:.0f} | {extra} |", flush=True)
    if args.out:
        lens = {w: [len(p) for p in ps] for w, (ps, _) in workloads.items()}
        with open(args.out, "w") as f:
            json.dump({"split": list(split), "prefill_ranks": args.prefill_ranks, "concurrency": args.concurrency,
                       "prompt_lens": {w: float(np.mean(v)) for w, v in lens.items()}, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
