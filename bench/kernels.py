"""The Triton kernels against their torch references and against the machine's own measured limits, on CUDA.

For each op and shape: the median time (and the 20th-80th percentile), the rate (GB/s of KV read for decode,
TFLOP/s for prefill and MoE), the ratio to the torch reference measured in the same run, and the ratio to the
machine's limit measured in the same run: a device-to-device copy for bandwidth, a dense bf16 matmul for
compute (of equal FLOPs for the MoE; 8192^3 for prefill). Also each output's largest difference from the
reference, over the reference's largest magnitude. Times by `triton.testing.do_bench` (L2 flushed between repeats).

Shapes: decode at batch 64 x context 4096 and batch 1 x 32768 (Qwen3-30B-A3B attention: 32 query heads,
4 KV heads, head dim 128, block size 16, bf16); prefill chunks of 512 (after 3584 cached tokens) and 4096;
MoE of Qwen3-30B-A3B shape (H 2048, I 768, 128 experts on the rank, top-8) and DeepSeek-V3 shape (H 7168,
I 2048, 8 of 256 experts on the rank, top-8: a received row has about one local choice) at 128, 1024 and 8192
rows per rank.

Without CUDA it says so and exits 0. `--smoke` runs tiny shapes on whatever device there is (on CPU under
TRITON_INTERPRET=1), to check the script itself; its times mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

ATTN = dict(heads=32, kv_heads=4, head_dim=128, block_size=16)
SMOKE_ATTN = dict(heads=4, kv_heads=2, head_dim=64, block_size=16)
MOE = {"qwen3-30b-a3b": dict(H=2048, I=768, experts=128, slots=128, K=8),
       "deepseek-v3": dict(H=7168, I=2048, experts=256, slots=8, K=8)}
SMOKE_MOE = {"qwen3-like": dict(H=64, I=32, experts=8, slots=8, K=2),
             "deepseek-like": dict(H=64, I=32, experts=16, slots=4, K=4)}


def timer(fn, device: torch.device) -> tuple[float, float, float]:
    """fn's (median, p20, p80) in ms."""
    if device.type == "cuda":
        import triton.testing
        return tuple(triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8]))
    fn()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[0], times[-1]


def limits(device: torch.device, smoke: bool) -> dict:
    """The machine's measured copy bandwidth (GB/s, read + write) and dense bf16 matmul rate (TFLOP/s)."""
    n = (1 << 20) if smoke else (1 << 29)
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src), device)[0]
    m = 256 if smoke else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    mm_ms = timer(lambda: a @ a, device)[0]
    return {"copy_GBps": 2 * src.numel() * 2 / copy_ms / 1e6, "matmul_TFLOPs": 2 * m ** 3 / mm_ms / 1e9}


def dense_matmul_tflops(flops: float, H: int, I: int, device: torch.device) -> float:
    """The rate of one dense bf16 matmul [flops / (6 H I), H] @ [H, 3I]: the MoE's FLOPs in one GEMM."""
    a = torch.randn(max(1, round(flops / (6 * H * I))), H, dtype=torch.bfloat16, device=device)
    b = torch.randn(H, 3 * I, dtype=torch.bfloat16, device=device)
    return flops / timer(lambda: a @ b, device)[0] / 1e9


def paged_kv(lens: list[int], shape: dict, device: torch.device, gen: torch.Generator):
    """A bf16 KV pool with every sequence's blocks scattered -> k_cache, v_cache, block_tables `[B, M]` int32."""
    bs, kvh, d = shape["block_size"], shape["kv_heads"], shape["head_dim"]
    blocks = [-(-L // bs) for L in lens]
    N = sum(blocks)
    k = torch.randn(N, bs, kvh, d, dtype=torch.bfloat16, device=device)
    v = torch.randn(N, bs, kvh, d, dtype=torch.bfloat16, device=device)
    perm = torch.randperm(N, generator=gen).to(torch.int32)
    tables = torch.full((len(lens), max(blocks)), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    return k, v, tables.to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference from the reference, over the reference's largest magnitude."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def row(op, shape, ours, ref, rate, unit, limit, err) -> dict:
    return {"op": op, "shape": shape, "ms": ours[0], "ms_p20": ours[1], "ms_p80": ours[2], "rate": rate,
            "unit": unit, "torch_ms": ref[0], "vs_torch": ref[0] / ours[0], "vs_limit": rate / limit,
            "max_rel_err": err}


def bench_attention(device, lim, smoke, gen) -> list[dict]:
    from kernels import ops
    from kernels.paged_attention import plan_decode
    shape = SMOKE_ATTN if smoke else ATTN
    h, kvh, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block_size"]
    scale = d ** -0.5
    rows = []
    for B, ctx in ([(3, 70), (1, 300)] if smoke else [(64, 4096), (1, 32768)]):
        k, v, tables = paged_kv([ctx] * B, shape, device, gen)
        q = torch.randn(B, h, d, dtype=torch.bfloat16, device=device)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        call = partial(ops.paged_decode_attention, q, k, v, tables, lens, scale)
        triton_call = partial(call, "triton", max_context_len=ctx)
        torch_call = partial(call, "torch", plan=plan_decode(tables, lens, bs))
        ours, ref = timer(triton_call, device), timer(torch_call, device)
        err = rel_err(triton_call(), torch_call())
        nbytes = 2 * B * ctx * kvh * d * 2 + 2 * q.numel() * 2
        rows.append(row("decode", f"{B} x {ctx}", ours, ref, nbytes / ours[0] / 1e6, "GB/s", lim["copy_GBps"], err))
    for chunk, ctx in ([(20, 50), (50, 50)] if smoke else [(512, 4096), (4096, 4096)]):
        k, v, tables = paged_kv([ctx], shape, device, gen)
        q = torch.randn(chunk, h, d, dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        lens = torch.tensor([ctx], dtype=torch.int32, device=device)
        triton_call, torch_call = (partial(ops.paged_prefill_attention, q, k, v, tables, cu, lens, scale, backend)
                                   for backend in ("triton", "torch"))
        ours, ref = timer(triton_call, device), timer(torch_call, device)
        err = rel_err(triton_call(), torch_call())
        flops = 4 * d * h * sum(p + 1 for p in range(ctx - chunk, ctx))     # QK^T and PV over the causal keys
        rows.append(row("prefill", f"{chunk} of {ctx}", ours, ref, flops / ours[0] / 1e9, "TFLOP/s",
                        lim["matmul_TFLOPs"], err))
    return rows


def moe_inputs(cfg: dict, N: int, device, gen):
    """N received rows: top-K distinct experts of cfg["experts"] each, the rank holding experts 0..slots-1; a row
    with no local expert would not have been sent, so such rows are drawn again."""
    E, S, K, H, I = cfg["experts"], cfg["slots"], cfg["K"], cfg["H"], cfg["I"]
    picks = torch.empty(0, K, dtype=torch.int64)
    while picks.shape[0] < N:
        draw = torch.rand(4 * N, E, generator=gen).topk(K, dim=1).indices
        picks = torch.cat([picks, draw[(draw < S).any(dim=1)]])
    picks = picks[:N]
    slots = torch.where(picks < S, picks, -1).to(device)
    weights = torch.rand(N, K, generator=gen).to(device)
    x = torch.randn(N, H, dtype=torch.bfloat16, device=device)
    w13 = (torch.randn(S, 2 * I, H, dtype=torch.bfloat16, device=device) / H ** 0.5)
    w2 = (torch.randn(S, H, I, dtype=torch.bfloat16, device=device) / I ** 0.5)
    return x, slots, weights, w13, w2


def bench_moe(device, smoke, gen) -> list[dict]:
    from kernels import ops
    rows = []
    for name, cfg in (SMOKE_MOE if smoke else MOE).items():
        for N in ([8, 40] if smoke else [128, 1024, 8192]):
            x, slots, weights, w13, w2 = moe_inputs(cfg, N, device, gen)
            pairs = int((slots >= 0).sum())
            triton_call, torch_call = (partial(ops.fused_moe, x, slots, weights, w13, w2, backend)
                                       for backend in ("triton", "torch"))
            ours, ref = timer(triton_call, device), timer(torch_call, device)
            err = rel_err(triton_call(), torch_call())
            flops = 6 * pairs * cfg["H"] * cfg["I"]
            dense = dense_matmul_tflops(flops, cfg["H"], cfg["I"], device)
            rows.append(row("fused_moe", f"{name} {N} rows ({pairs} pairs)", ours, ref, flops / ours[0] / 1e9,
                            "TFLOP/s", dense, err))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device, to check the script")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("bench/kernels.py: no CUDA device here, nothing to measure (the kernels' correctness is tested on CPU "
              "under TRITON_INTERPRET=1; their speed needs a GPU)")
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels are first imported
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    lim = limits(device, args.smoke)
    rows = bench_attention(device, lim, args.smoke, gen) + bench_moe(device, args.smoke, gen)
    print(f"{name}: copy {lim['copy_GBps']:.0f} GB/s, dense bf16 matmul {lim['matmul_TFLOPs']:.0f} TFLOP/s"
          + ("  [smoke run: times mean nothing]" if args.smoke else ""))
    print(f"{'op':<10} {'shape':<36} {'ms (p20-p80)':>24} {'rate':>16} {'torch ms':>10} {'vs torch':>9} "
          f"{'vs limit':>9} {'rel err':>9}")
    for r in rows:
        spread = f"{r['ms']:.4f} ({r['ms_p20']:.4f}-{r['ms_p80']:.4f})"
        print(f"{r['op']:<10} {r['shape']:<36} {spread:>24} {r['rate']:>9.1f} {r['unit']:<6} {r['torch_ms']:>10.4f} "
              f"{r['vs_torch']:>8.2f}x {r['vs_limit']:>9.2f} {r['max_rel_err']:>9.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "smoke": args.smoke, "limits": lim, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
