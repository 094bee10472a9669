"""The attention side's elementwise ops fused in C for fp32 on the CPU (kernel backend "cpu"): the residual add with
the RMSNorm after it, and the per-head q/k norm, rotary embedding and KV-cache write that follow the fused q/k/v
projection. The source is kernels/csrc/cpu_ops.c, built and loaded by kernels/cpu_build.py; it says how its
rounding compares with torch's. attention_nodes/model.py takes these where `AttentionModel` finds them usable and
the torch ops otherwise, so the other backends are the references.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import CSRC, FLAGS, build, loads
from .paged_attention import FP8_DTYPES, write_kv_ref

CACHE_DTYPES = (torch.float32, *FP8_DTYPES)    # the caches qkv_rope_write writes (float8 through fp32)

SOURCE = CSRC / "cpu_ops.c"
# Every product and sum rounded on its own, as torch's separate ops round them.
OPS_FLAGS = (*FLAGS, "-ffp-contract=off")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def library() -> ctypes.CDLL:
    """The built library. Raises BuildError naming the cause."""
    lib = build(SOURCE, OPS_FLAGS)
    lib.afserve_add_rms_norm_f32.restype = None
    lib.afserve_add_rms_norm_f32.argtypes = [_P, _I, _P, _I, _P, _P, _I, _I, _I, _F]
    lib.afserve_qkv_rope_write_f32.restype = None
    lib.afserve_qkv_rope_write_f32.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _F, _P, _P, _I, _P, _P, _P,
                                               _I, _I, _I, _I, _P]
    return lib


@functools.cache
def available() -> bool:
    """Whether the library builds and loads here (asked once per process)."""
    return loads(library)


def _rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name}: fp32 CPU rows with contiguous channels expected, got {t.dtype} on {t.device} "
                         f"of shape {tuple(t.shape)} and strides {t.stride()}")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h `[T, H]` += delta `[T, H]` in place (when given) -> RMSNorm(h) * weight `[T, H]`, a new tensor."""
    _rows(h, "h")
    if delta is not None:
        _rows(delta, "delta")
        if delta.shape != h.shape:
            raise ValueError(f"delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
    out = torch.empty_like(h)
    library().afserve_add_rms_norm_f32(h.data_ptr(), h.stride(0), None if delta is None else delta.data_ptr(),
                                       0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(),
                                       out.stride(0), h.shape[0], h.shape[1], eps)
    return out


def qkv_rope_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                   ) -> torch.Tensor:
    """qkv `[T, (h + 2 kvh) d]` rows [q | k | v] -> the queries `[T, h, d]`, normed per head (q_norm `[d]`, when
    given) and rotated; the keys (normed by k_norm, rotated) and the values go to k_cache / v_cache `[N, bs, kvh,
    d]` at slots `[T]` int64 (none -1). cos, sin `[T, rd]` (rd <= d, even): rotate-half tables. A float8 cache
    gets the keys and values through an fp32 staging copy, cast as `write_kv_ref` casts them."""
    _rows(qkv, "qkv")
    T = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (h + 2 kvh) d] for h={num_heads}, "
                         f"kvh={num_kv_heads}, d={head_dim}")
    rd = cos.shape[-1]
    cos, sin = cos.reshape(T, rd).contiguous(), sin.reshape(T, rd).contiguous()
    slots = slots.to(torch.int64).contiguous()
    if k_cache.dtype in FP8_DTYPES:
        k_new, v_new = (qkv.new_empty(T, 1, num_kv_heads, head_dim) for _ in range(2))
        q = qkv_rope_write(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, cos, sin,
                           torch.arange(T), k_new, v_new)
        write_kv_ref(k_cache, v_cache, k_new[:, 0], v_new[:, 0], slots, may_skip=False)
        return q
    q = qkv.new_empty(T, num_heads, head_dim)
    library().afserve_qkv_rope_write_f32(
        qkv.data_ptr(), qkv.stride(0), T, num_heads, num_kv_heads, head_dim,
        None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), rd, slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), q.data_ptr())
    return q


def supports_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether qkv_rope_write can write these caches: fp32 (or float8) CPU `[N, bs, kvh, d]` whose blocks lie one
    after another (a slot's address is slot * stride(1)) with each head's channels contiguous."""
    return all(c.dtype in CACHE_DTYPES and c.device.type == "cpu" and c.dim() == 4
               and c.shape[-1] == head_dim and c.stride(-1) == 1 and c.stride(0) == c.shape[1] * c.stride(1)
               for c in (k_cache, v_cache))
