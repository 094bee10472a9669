"""The C paged decode (kernel_backend "cpu") against the sdpa backend and the machine's copy bandwidth, same run.

Shapes: the shipped model's attention (4 query heads, 2 KV heads, head dim 64, fp32, 16-token blocks) at 4 sequences
(the K/V fits in the core's cache) and 64 sequences (the engine's batch, ~20 MB, from DRAM), contexts 100-500 tokens,
blocks scattered over an 8192-block cache as the block pool leaves them, on 1 and 2 threads.
Printed per case: median ns per context token and GB/s of K/V read (20th-80th percentile), the sdpa backend's time
(gather + scaled_dot_product_attention, one torch thread) and the ratio sdpa / C, and the GB/s of a torch copy of
as many bytes (the machine's limit for reading them once, measured here). Calls alternate between the kernels so
the VM's drift reaches both alike.
Run: python bench/cpu_decode.py [--repeats 200] [--warmup 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kernels import cpu_attention, sdpa_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16
CACHE_BLOCKS = 8192


def case(batch: int, gen: torch.Generator):
    lens = torch.randint(100, 500, (batch,), dtype=torch.int32, generator=gen)
    width = int((lens.max() + BLOCK - 1) // BLOCK)
    k = torch.randn(CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.randperm(CACHE_BLOCKS, generator=gen)[:batch * width].view(batch, width).to(torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    return q, k, v, tables, lens


def timed(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    print(f"{'case':<22}{'C ns/tok':>10}{'C GB/s (p20-p80)':>22}{'sdpa ns/tok':>13}{'sdpa/C':>8}{'copy GB/s':>11}")
    for batch in (4, 64):
        q, k, v, tables, lens = case(batch, gen)
        tokens = int(lens.sum())
        nbytes = tokens * KV_HEADS * HEAD_DIM * 4 * 2
        ref = sdpa_attention.paged_decode_attention(q, k, v, tables, lens, scale)
        src = torch.randn(nbytes // 4, generator=gen)
        dst = torch.empty_like(src)
        for threads in (1, 2):
            cpu_attention.set_threads(threads)
            out = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale)
            err = (out - ref).abs().max().item()
            if err > 1e-4:
                raise SystemExit(f"C decode differs from sdpa by {err} at batch {batch}")
            inputs = (q, k, v, tables, lens, scale)
            c_call = partial(cpu_attention.paged_decode_attention, *inputs)
            sdpa_call = partial(sdpa_attention.paged_decode_attention, *inputs)
            copy_call = partial(dst.copy_, src)
            c, s, cp = [], [], []
            for _ in range(4):      # alternate, in rounds
                c += timed(c_call, args.repeats // 4, args.warmup)
                s += timed(sdpa_call, max(args.repeats // 16, 3), 2)
                cp += timed(copy_call, args.repeats // 4, 2)
            mc, ms = statistics.median(c), statistics.median(s)
            spread = f"{nbytes / mc / 1e9:.1f} ({nbytes / pct(c, 0.8) / 1e9:.1f}-{nbytes / pct(c, 0.2) / 1e9:.1f})"
            print(f"{f'{batch} seqs, {threads} thr':<22}{mc / tokens * 1e9:>10.1f}{spread:>22}"
                  f"{ms / tokens * 1e9:>13.1f}{ms / mc:>8.2f}{nbytes / statistics.median(cp) / 1e9:>11.1f}")


if __name__ == "__main__":
    main()
