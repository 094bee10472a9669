"""Offline throughput against vLLM's CPU build, the peer, on the same workload in one run; prints the ratio.

Workload: bench/throughput.py's workload(): the shipped model (or --model), 256 requests (--requests), prompts of
16-256 tokens, outputs of 8-256 (long-tailed), fp32, greedy, ignore_eos, at most 64 requests in flight,
max_num_batched_tokens=512, prefix caching as each engine defaults (on in both; each run's hits are recorded), the
same KV cache space in both (--kv-space-gib, default 1: vLLM's VLLM_CPU_KVCACHE_SPACE; afserve's kv_cache_memory,
split among its attention ranks).
--prompts repeat (the default): every timed run is the same workload, so a run finds the earlier runs' prompts in
the prefix cache, as much as the KV space holds. --prompts fresh: timed run r gets workload(seed=r + 1), new
passages each run, the same in both engines: the cross-run cache hits are gone.
- vLLM: bench/vllm_offline.py under the peer venv's python (--peer-venv, default .venv-vllm; `make peers` builds
  it), `LLM(dtype="float32", max_num_seqs=64, max_num_batched_tokens=512)` and `LLM.generate` on token-id prompts,
  with bench/vllm_peer.py's environment.
- afserve: `LLM` at each split of --splits (A+E: A attention + E expert ranks; default 1+1,1+2), max_num_seqs=64 // A
  per attention rank (64 in flight in all), micro_batches=--micro-batches (default: auto, the engine's).
One engine runs at a time, never two:
1. afserve at the first split generates the first --num-check requests (greedy tokens);
2. vLLM generates them and fails (status 3, first differing position) if they differ, before any timing; then a
   warm-up (16 requests) and --repeats timed runs;
3. per split: the same check against vLLM's tokens (exit 1 on a difference), a warm-up, --repeats timed runs.
Printed: per system the median output tok/s and the runs, the ratio afserve/vLLM per split, and core utilisation
in each timed run from /proc (busy: all cores' busy share, whoever ran, since the machine may be shared; own: the
engine's processes' share of all cores). --out gets everything as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peer_common import CpuSample, describe_difference
from bench.throughput import workload
from bench.vllm_peer import TokenMismatch, run_offline
from launch import LLM, SamplingParams
from models import SHIPPED_MODEL

IN_FLIGHT = 64           # requests in flight in all, for both engines
MAX_BATCHED_TOKENS = 512
WARMUP_REQUESTS = 16


def parse_splits(text: str) -> list[tuple[int, int]]:
    """"1+1,1+2" -> [(1, 1), (1, 2)]: attention + expert ranks, each at least 1, attention ranks dividing 64."""
    splits = []
    for part in text.split(","):
        try:
            a, e = (int(x) for x in part.strip().split("+"))
        except ValueError as err:
            raise ValueError(f"--splits: {part!r} is not A+E (e.g. 1+2); pass a comma-separated list") from err
        if a < 1 or e < 1 or IN_FLIGHT % a:
            raise ValueError(f"--splits: {part!r} needs A >= 1 dividing {IN_FLIGHT} and E >= 1")
        splits.append((a, e))
    return splits


def greedy(olens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in olens]


def prefix_hits(llm: LLM) -> int:
    hits = llm.stats().get("prefix_cache_hits", 0)
    return sum(hits) if isinstance(hits, list) else int(hits)


def timed_workloads(mode: str, requests: int, repeats: int, model: str, prompts, olens) -> list[tuple[list, list]]:
    """One (prompts, olens) per timed run: the workload itself each time ("repeat"), or workload(seed=r + 1) for
    run r ("fresh")."""
    if mode == "repeat":
        return [(prompts, olens)] * repeats
    return [workload(requests, seed=r + 1, model=model) for r in range(repeats)]


def timed_run(llm: LLM, prompts: list[list[int]], olens: list[int]) -> dict:
    """One timed LLM.generate of the whole workload: seconds, tokens, tok/s, utilisation, prefix-cache hits."""
    hits = prefix_hits(llm)
    before = CpuSample.read(os.getpid())
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(olens))
    dt = time.perf_counter() - t0
    util = CpuSample.read(os.getpid()).since(before)
    n = sum(len(o.token_ids) for o in outs)
    if n != sum(olens):
        raise RuntimeError(f"afserve generated {n} tokens, the workload asked for {sum(olens)}")
    return {"seconds": dt, "tokens": n, "tok_s": n / dt, **util.to_dict(),
            "cached_prompt_tokens": prefix_hits(llm) - hits}


def run_split(model: str, split: tuple[int, int], micro_batches: int, kv_space_gib: int, prompts, olens,
              timed: list[tuple[list, list]], num_check: int, expect: list[list[int]] | None) -> dict:
    """afserve at one split: its check tokens (compared with expect when given, exit 1 on a difference), then a
    warm-up and one timed run per timed workload (none when timed is empty)."""
    A, E = split
    with LLM(model, attention_ranks=A, expert_ranks=E, max_num_seqs=IN_FLIGHT // A,
             max_num_batched_tokens=MAX_BATCHED_TOKENS, micro_batches=micro_batches,
             kv_cache_memory=(kv_space_gib << 30) // A) as llm:
        check = [o.token_ids for o in llm.generate(prompts[:num_check], greedy(olens[:num_check]))]
        if expect is not None:
            diff = describe_difference(check, expect, (f"afserve {A}+{E}", "vLLM"))
            if diff is not None:
                sys.exit(f"peers: greedy tokens differ at {diff}; no ratio is printed")
        runs = []
        if timed:
            llm.generate(prompts[:WARMUP_REQUESTS], greedy(olens[:WARMUP_REQUESTS]))
            runs = [timed_run(llm, p, o) for p, o in timed]
        picked = llm.stats()["micro_batches"]     # the leader's count (auto's pick when micro_batches is 0)
    return {"split": f"{A}+{E}", "attention_ranks": A, "expert_ranks": E, "max_num_seqs": IN_FLIGHT // A,
            "micro_batches": micro_batches, "micro_batches_run": picked, "check_tokens": check, "runs": runs}


def summarise(runs: list[dict]) -> dict:
    return {"median_tok_s": statistics.median(r["tok_s"] for r in runs),
            "median_busy": statistics.median(r["busy"] for r in runs),
            "median_own": statistics.median(r["own"] for r in runs)}


def fmt_runs(runs: list[dict]) -> str:
    return ", ".join(f"{r['tok_s']:.0f}" for r in runs)


def fmt_util(runs: list[dict]) -> str:
    return ", ".join(f"{100 * r['busy']:.0f}/{100 * r['own']:.0f}%" for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL, help="HF checkpoint directory (default: the shipped model)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per system, after a warm-up")
    ap.add_argument("--splits", default="1+1,1+2", help="afserve's attention+expert ranks, comma-separated")
    ap.add_argument("--micro-batches", type=int, default=0, help="afserve's micro_batches (default 0: the engine's "
                    "default, auto)")
    ap.add_argument("--num-check", type=int, default=4, help="requests whose greedy tokens must agree")
    ap.add_argument("--kv-space-gib", type=int, default=1, help="KV cache GiB for each engine (afserve: split among "
                                                                "its attention ranks)")
    ap.add_argument("--prompts", choices=("repeat", "fresh"), default="repeat",
                    help="repeat: every timed run is the same workload; fresh: new passages each run (no cross-run "
                         "prefix-cache hits)")
    ap.add_argument("--peer-venv", default=".venv-vllm", help="the venv with vllm-cpu (`make peers` builds it)")
    ap.add_argument("--out", default=os.path.join("bench", "out", "peers.json"))
    args = ap.parse_args()
    try:
        splits = parse_splits(args.splits)
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1 or args.num_check < 1 or args.kv_space_gib < 1:
        ap.error(f"--repeats {args.repeats}, --num-check {args.num_check} and --kv-space-gib {args.kv_space_gib} "
                 f"must be at least 1")
    prompts, olens = workload(args.requests, model=args.model)
    timed = timed_workloads(args.prompts, args.requests, args.repeats, args.model, prompts, olens)
    print(f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, output tokens {sum(olens)}; "
          f"{IN_FLIGHT} in flight, max_num_batched_tokens {MAX_BATCHED_TOKENS}, fp32, greedy, KV space "
          f"{args.kv_space_gib} GiB each; median of {args.repeats} runs after a warm-up, prompts {args.prompts}"
          + ("" if args.prompts == "repeat" else " (timed runs' prompt/output tokens: " + ", ".join(
              f"{sum(map(len, p))}/{sum(o)}" for p, o in timed) + ")"), flush=True)

    # Step 1: afserve's tokens for the check, so that the peer compares before it times anything.
    ours_check = run_split(args.model, splits[0], args.micro_batches, args.kv_space_gib, prompts, olens, [],
                           args.num_check, None)
    # Step 2: the peer, alone on the machine.
    try:
        peer = run_offline(args.peer_venv, args.model, prompts, olens, args.repeats, args.num_check,
                           expect=ours_check["check_tokens"], max_num_seqs=IN_FLIGHT,
                           max_num_batched_tokens=MAX_BATCHED_TOKENS,
                           timed=timed, kv_space_gib=args.kv_space_gib)
    except TokenMismatch as e:
        sys.exit(f"peers: vLLM's greedy tokens differ from afserve {ours_check['split']}'s: {e}; no ratio is printed")
    peer.update(summarise(peer["runs"]))
    print(f"vLLM {peer['vllm']} (CPU, {peer['env'].get('VLLM_CPU_OMP_THREADS_BIND')} binding): "
          f"{peer['median_tok_s']:.0f} tok/s (runs {fmt_runs(peer['runs'])}; busy/own {fmt_util(peer['runs'])}); "
          f"greedy tokens of {args.num_check} requests equal afserve's", flush=True)
    # Step 3: afserve at each split, checked against the peer's tokens before it is timed.
    ours = []
    for split in splits:
        r = run_split(args.model, split, args.micro_batches, args.kv_space_gib, prompts, olens, timed,
                      args.num_check, peer["check_tokens"])
        r.update(summarise(r["runs"]))
        r["ratio"] = r["median_tok_s"] / peer["median_tok_s"]
        ours.append(r)
        print(f"afserve {r['split']}: {r['median_tok_s']:.0f} tok/s (runs {fmt_runs(r['runs'])}; busy/own "
              f"{fmt_util(r['runs'])}), {r['ratio']:.2f}x vLLM", flush=True)

    print("\n| system | output tok/s (median; runs) | vs vLLM | all cores busy (median) | own share (median) |\n"
          "|---|---|---|---|---|")
    for name, r, ratio in [(f"vLLM {peer['vllm']}", peer, 1.0)] + [(f"afserve {r['split']}", r, r["ratio"])
                                                                     for r in ours]:
        print(f"| {name} | {r['median_tok_s']:.0f} ({fmt_runs(r['runs'])}) | {ratio:.2f}x | "
              f"{100 * r['median_busy']:.0f}% | {100 * r['median_own']:.0f}% |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": platform.node(),
                   "cores": os.cpu_count(), "args": vars(args),
                   "workload": {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                                "output_tokens": sum(olens), "in_flight": IN_FLIGHT,
                                "max_num_batched_tokens": MAX_BATCHED_TOKENS, "prompts": args.prompts,
                                "timed_tokens": [[sum(map(len, p)), sum(o)] for p, o in timed]},
                   "vllm": peer, "afserve": ours}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
