"""Speculative decoding: TPOT and output throughput of the OpenAI-compatible server with speculation off, with
prompt-lookup (n-gram) drafts and with the shipped draft model, at concurrency 1, 8 and 64, in the same run; and
the acceptance rate per draft position.

The server is launch/serve.py under torchrun (1 attention + 1 expert rank by default, --split) on loopback,
serving the shipped Shakespeare MoE (or --model). Requests: bench/serve_load.py's client and workload (greedy,
ignore_eos, streaming, prompts of 16-256 tokens of the held-out play, outputs of 8-128 tokens, long-tailed); at
concurrency c, max(8, 2c) requests. The servers run side by side (an idle one takes ~1% of a core); each level
runs --repeats rounds after a warm-up, a round sending the level to each server in turn (the order rotating every
round, so that the VM's drift over minutes falls on all alike), and the median run (by throughput) of each is
printed. TPOT: (last chunk - first chunk) / (tokens - 1), per request; p50 over the requests of the run.
Acceptance rate at draft position j: the drafts accepted at j / the requests verified with drafts (vLLM's
definition), from the server's /metrics counters over the level's runs.
The peer is the same server with speculation off, measured in the same run: the ratio columns are off / config
for TPOT (higher is better) and config / off for throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peers import parse_splits
from bench.serve_load import requests, run_level
from launch.local_server import LocalServer
from models import SHIPPED_MODEL

LEVELS = (1, 8, 64)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT = os.path.join(os.path.dirname(SHIPPED_MODEL), "shakespeare-draft")


def spec_counters(url: str) -> dict:
    """The server's speculative decoding counters: drafts, draft tokens, accepted, accepted per position."""
    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    names = {"afserve_spec_decode_num_drafts_total": "drafts", "afserve_spec_decode_num_draft_tokens_total":
             "draft_tokens", "afserve_spec_decode_num_accepted_tokens_total": "accepted"}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in names:
            out[names[name]] = float(value)
        elif name.startswith("afserve_spec_decode_num_accepted_tokens_per_pos_total{"):
            out["per_pos"][int(name.split('position="')[1].split('"')[0])] = float(value)
    return out


def server_args(split: tuple[int, int], spec: dict | None, limits: list[str]) -> list[str]:
    args = ["--attention-ranks", str(split[0]), "--served-model-name", "bench", *limits]
    return args if spec is None else args + ["--speculative-config", json.dumps(spec)]


def run_levels(urls: dict[str, str], levels: list[int], repeats: int, model: str, ks: dict[str, int]
               ) -> dict[str, dict]:
    """Per level, `repeats` rounds; each round runs the level on every server in turn (the order rotates every
    round), so that the VM's drift over minutes falls on all alike. -> {config: {level: the median run}}."""
    warm_p, warm_o = requests(8, seed=1, model=model)
    for url in urls.values():
        asyncio.run(run_level(url, 8, warm_p, warm_o))
    names = list(urls)
    out: dict[str, dict] = {name: {} for name in urls}
    for c in levels:
        prompts, olens = requests(max(8, 2 * c), seed=c, model=model)
        runs: dict[str, list] = {name: [] for name in urls}
        before = {name: spec_counters(url) for name, url in urls.items()}
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs[name].append(asyncio.run(run_level(urls[name], c, prompts, olens)))
        for name, url in urls.items():
            after = spec_counters(url)
            drafts = after["drafts"] - before[name]["drafts"]
            per_pos = [(after["per_pos"].get(j, 0) - before[name]["per_pos"].get(j, 0)) / drafts if drafts else 0.0
                       for j in range(ks.get(name, 0))]
            drafted = after["draft_tokens"] - before[name]["draft_tokens"]
            accepted = after["accepted"] - before[name]["accepted"]
            ranked = sorted(runs[name], key=lambda x: x["tok_s"])
            out[name][c] = {**ranked[len(ranked) // 2], "runs": [x["tok_s"] for x in runs[name]],
                            "acceptance_per_pos": per_pos,
                            "draft_acceptance": accepted / drafted if drafted else 0.0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), help=f"concurrency levels (default "
                    f"{LEVELS})")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level (default 3)")
    ap.add_argument("--model", default=SHIPPED_MODEL, help="HF checkpoint directory (default: the shipped model)")
    ap.add_argument("--split", default="1+1", help="attention+expert ranks (default 1+1)")
    ap.add_argument("--speculative-config", default=json.dumps(NGRAM), type=json.loads,
                    help=f"the 'ngram' configuration measured against off (default {json.dumps(NGRAM)})")
    ap.add_argument("--draft-model", default=DRAFT if os.path.isdir(DRAFT) else None,
                    help="the draft checkpoint of the 'draft' configuration (default: the shipped draft, "
                         "models/shakespeare-draft; '' leaves it out)")
    ap.add_argument("--draft-tokens", type=int, default=3, help="num_speculative_tokens of the draft (default 3)")
    ap.add_argument("--draft-off-at", type=int, default=32,
                    help="the draft's disable_by_batch_size (default 32: its k forwards and the extra positions it "
                         "verifies cost more than they save in a large batch on this CPU; 0: never off)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="one run at concurrency 2 per configuration: a quick run "
                    "that checks the bench works (tests run it; its figures mean little)")
    args = ap.parse_args()
    if args.smoke:
        args.levels, args.repeats = [2], 1
    try:
        (split,) = parse_splits(args.split)
    except ValueError as e:
        ap.error(str(e).replace("--splits", "--split"))
    limits = ["--max-num-seqs", "64", "--max-num-batched-tokens", "512"]
    configs = {"off": None, "ngram": args.speculative_config}
    if args.draft_model:
        configs["draft"] = {"method": "draft_model", "model": args.draft_model,
                            "num_speculative_tokens": args.draft_tokens}
        if args.draft_off_at:
            configs["draft"]["disable_by_batch_size"] = args.draft_off_at
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(LocalServer(args.model, nproc=sum(split),
                                                      args=server_args(split, cfg, limits))).url
                for name, cfg in configs.items()}
        results = run_levels(urls, args.levels, args.repeats, args.model,
                             {name: cfg["num_speculative_tokens"] for name, cfg in configs.items() if cfg})
    print(f"{'+'.join(map(str, split))} ranks; median of {args.repeats} run(s) per level after a warm-up; "
          + "; ".join(f"{name}: {json.dumps(cfg)}" for name, cfg in configs.items() if cfg))
    print("| concurrency | requests | config | TPOT p50 ms | TPOT off/config | output tok/s | tok/s config/off | "
          "draft tokens accepted | acceptance per position |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in args.levels:
        off = results["off"][c]
        for name in configs:
            r = results[name][c]
            pos = ", ".join(f"{x:.2f}" for x in r["acceptance_per_pos"]) or "-"
            print(f"| {c} | {r['requests']} | {name} | {r['tpot_p50']:.2f} | {off['tpot_p50'] / r['tpot_p50']:.2f}x | "
                  f"{r['tok_s']:.0f} | {r['tok_s'] / off['tok_s']:.2f}x | {r['draft_acceptance']:.2f} | {pos} |",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"configs": configs, "split": list(split), "results": results}, f, indent=1)

if __name__ == "__main__":
    main()
