"""Online serving: TTFT and TPOT (p50, p99) and output throughput of the OpenAI-compatible server at
concurrency 1, 8, 32 and 64, against HF `generate` on the same requests in the same run.

The server is launch/serve.py under torchrun (1 attention + 2 expert ranks) on loopback, serving the tiny
random Qwen3-MoE of bench/throughput.py. Clients: the `openai` async client, streaming, greedy, ignore_eos,
token-id prompts of 16-256 tokens, outputs of 8-128 tokens (long-tailed). At concurrency c, max(16, 4c)
requests; each level runs --repeats times after a warm-up and the median run (by throughput) is printed.
TTFT: request sent -> first streamed chunk. TPOT: (last chunk - first chunk) / (tokens - 1), per request.
The peer: HF generate in static batches of 64 on the c=64 request set (useful tokens per second).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from bench.throughput import MODEL, run_hf, workload
from launch.local_server import LocalServer
from models.tiny import make_tiny_checkpoint

LEVELS = (1, 8, 32, 64)


def requests(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    return workload(n, seed, max_output=128)


async def run_level(url: str, concurrency: int, prompts, olens) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    ttft, tpot, tokens = [], [], []

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
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
            "tpot_p99": pct(tpot, 99), "tok_s": sum(tokens) / wall, "requests": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench")
        make_tiny_checkpoint("qwen3_moe", path, **MODEL)
        torch.set_num_threads(os.cpu_count() or 1)
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hp, ho = requests(max(16, 4 * max(args.levels)), seed=64)
        run_hf(hf, hp[:16], ho[:16])                       # warm-up
        hf_runs = []
        for _ in range(args.repeats):
            dt, n = run_hf(hf, hp, ho)
            hf_runs.append(n / dt)
        hf_tok_s = statistics.median(hf_runs)
        del hf
        print(f"HF generate (batches of 64) on the c={max(args.levels)} requests: {hf_tok_s:.0f} tok/s "
              f"(median of {args.repeats}: {', '.join(f'{x:.0f}' for x in hf_runs)})")
        with LocalServer(path, nproc=3, args=["--attention-ranks", "1", "--served-model-name", "bench",
                                              "--max-num-seqs", "64"]) as srv:
            warm_p, warm_o = requests(8, seed=1)
            asyncio.run(run_level(srv.url, 8, warm_p, warm_o))
            print("| concurrency | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s "
                  "(median) | vs HF generate |")
            print("|---|---|---|---|---|---|---|---|")
            for c in args.levels:
                prompts, olens = requests(max(16, 4 * c), seed=c)
                runs = sorted((asyncio.run(run_level(srv.url, c, prompts, olens)) for _ in range(args.repeats)),
                              key=lambda r: r["tok_s"])
                r = runs[len(runs) // 2]
                spread = ", ".join(f"{x['tok_s']:.0f}" for x in runs)
                print(f"| {c} | {r['requests']} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['tpot_p50']:.2f} | "
                      f"{r['tpot_p99']:.2f} | {r['tok_s']:.0f} ({spread}) | "
                      f"{r['tok_s'] / hf_tok_s:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
