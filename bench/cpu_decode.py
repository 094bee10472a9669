"""The C paged decode (kernel_backend "cpu") against the sdpa backend and the machine's copy bandwidth, same run.

Shapes: the shipped model's attention (4 query heads, 2 KV heads, head dim 64, fp32, 16-token blocks) at 4 sequences
(the K/V fits in the core's cache), 64 sequences (the engine's batch, ~20 MB: it fits this VM's 32 MB L3, so calls
after the first read it from there), and "64 seqs x10": 64 sequences over 10 caches of their own (one per layer,
as in the engine), a call per cache in turn, so each call reads its K/V from DRAM. Contexts 100-500 tokens, blocks
scattered over the cache as the block pool leaves them, on 1 and 2 threads.
Printed per case: median ns per context token and GB/s of K/V read (20th-80th percentile), the sdpa backend's time
(gather + scaled_dot_product_attention, one torch thread) and the ratio sdpa / C, and the GB/s of a torch copy of
as many bytes (the machine's limit for reading them once, measured here). Calls alternate between the kernels so
the VM's drift reaches both alike.
--baseline FILE also builds another version of the kernel source (e.g. `git show REV:kernels/csrc/paged_decode.c`,
REV from 69791ab on, which renamed its entry point afserve_paged_decode) and times it in the same rounds: the
"base/C" column is its time over this one's. --kv-dtype fp8 or fp8_e5m2 times the same cases over a float8 cache
(the engine's kv_cache_dtype; a quarter of the bytes, widened in registers); run it beside the default fp32 run
to compare.
Run: python bench/cpu_decode.py [--repeats 200] [--warmup 20] [--baseline FILE] [--kv-dtype fp32|fp8|fp8_e5m2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kernels import cpu_attention, sdpa_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16
CACHE_BLOCKS = 8192
LAYERS = 10        # caches cycled in the DRAM case: 10 x ~20 MB, far over the L3
KV_DTYPES = {"fp32": torch.float32, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def case(batch: int, gen: torch.Generator):
    lens = torch.randint(100, 500, (batch,), dtype=torch.int32, generator=gen)
    width = int((lens.max() + BLOCK - 1) // BLOCK)
    k = torch.randn(CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.randperm(CACHE_BLOCKS, generator=gen)[:batch * width].view(batch, width).to(torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    return q, k, v, tables, lens


def call_with(lib, inputs) -> torch.Tensor:
    """The C decode through library `lib` (this source's or the baseline's build)."""
    keep = cpu_attention.library
    cpu_attention.library = lambda kv_dtype=torch.float32: lib
    try:
        return cpu_attention.paged_decode_attention(*inputs)
    finally:
        cpu_attention.library = keep


class Cycle:
    """Calls fn on each of several inputs in turn (one per layer's cache): each call finds its K/V out of cache."""

    def __init__(self, fn, inputs: list):
        self.fn, self.inputs, self.i = fn, inputs, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.inputs)
        return self.fn(self.inputs[self.i])


def layer_caches(q, k, v, tables, lens, scale, layers: int, gen: torch.Generator) -> list[tuple]:
    """`layers` copies of a case's inputs, each with K/V caches of its own holding just the case's blocks."""
    used = tables.flatten()
    remap = torch.empty(k.shape[0], dtype=torch.int32)
    remap[used.long()] = torch.arange(used.numel(), dtype=torch.int32)
    small = remap[tables.long()]
    return [(q, torch.randn(used.numel(), *k.shape[1:], generator=gen).to(k.dtype),
             torch.randn(used.numel(), *v.shape[1:], generator=gen).to(v.dtype), small, lens, scale)
            for _ in range(layers)]


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
    ap.add_argument("--baseline", type=Path, help="another paged_decode.c to time beside this one")
    ap.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default="fp32", help="what the K/V caches hold")
    args = ap.parse_args()
    kv_dtype = KV_DTYPES[args.kv_dtype]
    libraries = {"C": cpu_attention.library(kv_dtype)}
    if args.baseline:
        source = cpu_attention.SOURCE
        cpu_attention.SOURCE = args.baseline
        cpu_attention.library.cache_clear()
        libraries["base"] = cpu_attention.library(kv_dtype)
        cpu_attention.SOURCE = source
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    print(f"{'case':<22}{'C ns/tok':>10}{'C GB/s (p20-p80)':>22}{'sdpa ns/tok':>13}{'sdpa/C':>8}{'copy GB/s':>11}"
          + (f"{'base ns/tok':>13}{'base/C':>8}" if args.baseline else ""))
    for batch, layers in ((4, 1), (64, 1), (64, LAYERS)):
        q, k, v, tables, lens = case(batch, gen)
        k, v = k.to(kv_dtype), v.to(kv_dtype)
        per_layer = layer_caches(q, k, v, tables, lens, scale, layers, gen) if layers > 1 else None
        tokens = int(lens.sum())
        nbytes = tokens * KV_HEADS * HEAD_DIM * k.element_size() * 2
        ref = sdpa_attention.paged_decode_attention(q, k, v, tables, lens, scale)
        src = torch.randn(nbytes // 4, generator=gen)
        dst = torch.empty_like(src)
        for threads in (1, 2):
            for lib in libraries.values():
                lib.afserve_set_threads(threads)
            out = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale)
            err = (out - ref).abs().max().item()
            if per_layer:
                out = cpu_attention.paged_decode_attention(*per_layer[1])
                err = max(err, (out - sdpa_attention.paged_decode_attention(*per_layer[1])).abs().max().item())
            if err > 1e-4:
                raise SystemExit(f"C decode differs from sdpa by {err} at batch {batch}")
            cases = per_layer or [(q, k, v, tables, lens, scale)]
            c_call = Cycle(partial(call_with, libraries["C"]), cases)
            base_call = Cycle(partial(call_with, libraries.get("base")), cases)
            sdpa_call = Cycle(lambda inputs: sdpa_attention.paged_decode_attention(*inputs), cases)
            copy_call = partial(dst.copy_, src)
            c, s, cp, base = [], [], [], []
            for _ in range(4):      # alternate, in rounds
                c += timed(c_call, args.repeats // 4, args.warmup)
                if args.baseline:
                    base += timed(base_call, args.repeats // 4, args.warmup)
                s += timed(sdpa_call, max(args.repeats // 16, 3), 2)
                cp += timed(copy_call, args.repeats // 4, 2)
            mc, ms = statistics.median(c), statistics.median(s)
            spread = f"{nbytes / mc / 1e9:.1f} ({nbytes / pct(c, 0.8) / 1e9:.1f}-{nbytes / pct(c, 0.2) / 1e9:.1f})"
            name = f"{batch} seqs{f' x{layers}' if layers > 1 else ''}, {threads} thr"
            print(f"{name:<22}{mc / tokens * 1e9:>10.1f}{spread:>22}"
                  f"{ms / tokens * 1e9:>13.1f}{ms / mc:>8.2f}{nbytes / statistics.median(cp) / 1e9:>11.1f}"
                  + (f"{statistics.median(base) / tokens * 1e9:>13.1f}{statistics.median(base) / mc:>8.2f}"
                     if base else ""))


if __name__ == "__main__":
    main()
