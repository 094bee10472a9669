"""The one entry point to the kernels. Every op takes `backend`: "triton" (CUDA tensors, or any tensors under
Triton's CPU interpreter, `TRITON_INTERPRET=1`), "cpu" (fp32 paged decode in C reading the cache in place,
kernels/cpu_attention.py, and the attention side's norms, rotary embedding and KV writes fused in C,
kernels/cpu_ops.py; everything else as "sdpa"), "sdpa" (attention on torch's fused
scaled_dot_product_attention, kernels/sdpa_attention.py; everything else as "torch"), "torch" (the references
beside each kernel), or "auto": Triton on CUDA; on the CPU "cpu" where its C kernel builds, else sdpa. The Triton
modules are imported only when first used.

Names: T tokens, B sequences, P prefill sequences, h query heads, kvh KV heads, d head dim, N cache blocks,
bs block size, M max blocks per sequence, H hidden, I expert intermediate size, S slots, K top-k.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

from . import cpu_attention, cpu_build, cpu_ops, sdpa_attention
from .moe import SILU, ExpertAct, fused_moe_ref
from .paged_attention import (
    DecodeGroup,
    kv_bits,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    plan_decode,
    to_kv,
    write_kv_ref,
)

BACKENDS = ("auto", "triton", "cpu", "sdpa", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (asked once: every op call resolves its backend)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """One of BACKENDS on `device` -> the backend that runs: "triton", "cpu", "sdpa" or "torch".
    Raises ValueError for a backend that cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is invalid: choose one of {BACKENDS}")
    kind = torch.device(device).type
    is_cuda = kind == "cuda"
    if backend == "auto":
        if is_cuda and triton_available():
            return "triton"
        return "cpu" if kind == "cpu" and cpu_attention.available() and cpu_ops.available() else "sdpa"
    if backend == "cpu":
        if kind != "cpu":
            raise ValueError(f"kernel backend 'cpu' runs on the CPU only, not on {kind}; use 'auto'")
        try:
            cpu_attention.library()
            cpu_ops.library()
        except (cpu_build.BuildError, OSError) as e:
            raise ValueError(str(e)) from e
    if backend == "triton":
        if not triton_available():
            raise ValueError("kernel backend 'triton' needs the triton package (pip install triton); "
                             "use 'auto' or 'torch'")
        if not is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"kernel backend 'triton' on {torch.device(device).type} runs only under Triton's "
                             f"interpreter (set TRITON_INTERPRET=1 before starting; slow, meant for tests); "
                             f"use 'auto' or 'torch'")
    return backend


@functools.cache
def _triton(module: str):
    return importlib.import_module(f"kernels.triton_{module}")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str = "auto", may_skip: bool = True) -> None:
    """k, v `[T, kvh, d]` into k_cache, v_cache `[N, bs, kvh, d]` at slot_mapping `[T]` int64 flat slots
    (block * bs + offset), -1 = skip (padding). may_skip=False: no slot is -1 (the torch path then reads
    nothing back from the device)."""
    if resolve_backend(backend, k.device) == "triton":
        _triton("attention").write_kv(k_cache, v_cache, k, v, slot_mapping)
    else:
        write_kv_ref(k_cache, v_cache, k, v, slot_mapping, may_skip)


def plan_decode_attention(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                          backend: str = "auto", host_lens: list[int] | None = None) -> list[DecodeGroup] | None:
    """What the torch backend's decode gathers, worked out once per step and passed to every layer's call as
    `plan`; None for Triton, which needs no plan. host_lens: context_lens as a host list, where known."""
    resolved = resolve_backend(backend, block_tables.device)
    if resolved in ("triton", "cpu"):
        return None
    if resolved == "sdpa":
        return plan_decode(block_tables, context_lens, block_size, sdpa_attention.DECODE_GROUP, host_lens)
    return plan_decode(block_tables, context_lens, block_size, host_lens=host_lens)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           backend: str = "auto", *, max_context_len: int | None = None,
                           plan: list[DecodeGroup] | None = None, sinks: torch.Tensor | None = None,
                           window: int | None = None) -> torch.Tensor:
    """One query per sequence. q `[B, h, d]`; block_tables `[B, M]` int32, -1 padded; context_lens `[B]` int32,
    counting the token being decoded (its K/V already written) -> `[B, h, d]` in q.dtype.
    max_context_len: a host-side bound on context_lens (Triton sizes its split-KV grid by it; default M * bs);
    plan: `plan_decode_attention` of the same tables (torch; made here when None); sinks `[h]` fp32: per-head
    logits that join the softmax's normalisation and attend to nothing (GPT-OSS); window: each query sees only
    its last `window` positions, itself included (None: all)."""
    _check_window(window)
    resolved = resolve_backend(backend, q.device)
    if resolved == "triton":
        return _triton("attention").paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                           max_context_len, sinks=sinks, window=window)
    if resolved == "cpu" and cpu_attention.supports(q, k_cache, v_cache):
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sinks,
                                                    window)
    if resolved in ("cpu", "sdpa"):
        return sdpa_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, plan,
                                                     sinks, window)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, plan, sinks, window)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, backend: str = "auto", *, sinks: torch.Tensor | None = None,
                            window: int | None = None, host_cu_seqlens: list[int] | None = None,
                            host_context_lens: list[int] | None = None) -> torch.Tensor:
    """Prefill chunks over cached prefixes. q `[T, h, d]`: sequence i's queries are rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and its last positions of context_lens[i] tokens, whose K/V are written;
    block_tables `[P, M]` int32; cu_seqlens_q `[P+1]` int32; context_lens `[P]` int32 -> `[T, h, d]`, causal.
    sinks, window: as in `paged_decode_attention`. host_cu_seqlens / host_context_lens: the same values as host
    lists where the caller has them (sdpa then reads nothing back from the device)."""
    _check_window(window)
    resolved = resolve_backend(backend, q.device)
    if resolved == "triton":
        return _triton("attention").paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                            context_lens, scale, sinks=sinks, window=window)
    if resolved in ("cpu", "sdpa"):
        return sdpa_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                      scale, sinks, window, host_cu_seqlens=host_cu_seqlens,
                                                      host_context_lens=host_context_lens)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, sinks,
                                       window)


def _check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r} must be a positive int (or None for full attention)")


def write_latent(cache: torch.Tensor, entry: torch.Tensor, slot_mapping: torch.Tensor,
                 backend: str = "auto", may_skip: bool = True) -> None:
    """MLA: entry `[T, 1, c + r]` (latent, then rotary key) into cache `[N, bs, 1, c + r]` at slot_mapping `[T]`
    (-1 = skip; may_skip=False: none is, nothing is checked). One indexed copy on every backend: there is nothing
    for a kernel to fuse."""
    N, bs, one, width = cache.shape
    keep = slot_mapping >= 0
    if may_skip and not bool(keep.all()):
        entry, slot_mapping = entry[keep], slot_mapping[keep]
    kv_bits(cache.view(N * bs, one, width)).index_copy_(0, slot_mapping, kv_bits(to_kv(entry, cache.dtype)))


def paged_mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, backend: str = "auto", *, v_dim: int, max_context_len: int | None = None,
                     plan: list[DecodeGroup] | None = None) -> torch.Tensor:
    """Weight-absorbed MLA decode over the latent cache. q `[B, h, c + r]` (the no-rope query already folded
    through W_UK, then the rotary query); cache `[N, bs, 1, c + r]` ([latent | rotary key] per token) ->
    `[B, h, c]`: softmax(q . entry * scale) over the context, times the latents; v_dim is c (kv_lora_rank).
    It is multi-query attention with one KV head whose values are the first c channels of the keys, so it runs
    on the paged decode kernels with the cache as both K and V (the r extra value channels are computed and
    dropped: r / c = 1/8 more work at DeepSeek-V3 shapes)."""
    out = paged_decode_attention(q, cache, cache, block_tables, context_lens, scale, backend,
                                 max_context_len=max_context_len, plan=plan)
    return out[..., :_latent_width(cache, v_dim)]


def paged_mla_prefill(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, backend: str = "auto", *,
                      v_dim: int, host_cu_seqlens: list[int] | None = None,
                      host_context_lens: list[int] | None = None) -> torch.Tensor:
    """Weight-absorbed MLA prefill over cached prefixes, causal: as `paged_prefill_attention` with the latent
    cache as both K and V. q `[T, h, c + r]` -> `[T, h, c]`."""
    out = paged_prefill_attention(q, cache, cache, block_tables, cu_seqlens_q, context_lens, scale, backend,
                                  host_cu_seqlens=host_cu_seqlens, host_context_lens=host_context_lens)
    return out[..., :_latent_width(cache, v_dim)]


def _latent_width(cache: torch.Tensor, v_dim: int) -> int:
    if not 0 < v_dim <= cache.shape[-1]:
        raise ValueError(f"v_dim={v_dim} must be in 1..{cache.shape[-1]} (the cache entry width)")
    return v_dim


def fused_moe(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              backend: str = "auto", *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              act: ExpertAct = SILU) -> torch.Tensor:
    """x `[N, H]`; slots `[N, K]` int64 local slot, -1 = that choice lives on another rank; weights `[N, K]` fp32;
    w13 `[S, 2I, H]` (gate rows, then up rows); w2 `[S, H, I]` -> `[N, H]` in x.dtype:
    sum_k weights[n, k] * FFN_{slots[n, k]}(x[n]). b13 `[S, 2I]`, b2 `[S, H]` and act (GPT-OSS's biases and
    clamped SwiGLU) run the torch reference on every backend: the Triton kernel fuses plain SwiGLU only."""
    if resolve_backend(backend, x.device) == "triton" and b13 is None and b2 is None and act == SILU:
        return _triton("moe").fused_moe(x, slots, weights, w13, w2)
    return fused_moe_ref(x, slots, weights, w13, w2, b13, b2, act)
