"""Paged decode attention in C for the CPU: reads each sequence's K/V blocks where they lie in the cache, where the
sdpa backend gathers a copy of them first (decode attention is memory-bound, so the copy costs about as much as
the attention). The source is kernels/csrc/paged_decode.c, built and loaded by kernels/cpu_build.py once per cache
element type: fp32, or float8 (e4m3fn, e5m2; widened to fp32 in registers, so a float8 cache is read at a quarter
of the bytes). fp32 queries on the CPU take it; anything else, and prefill, go to the sdpa backend. A call can
split its sequences over
a few threads of the library's own (`set_threads`): on a CPU, attention ranks are busy while the expert ranks
wait, so the cores the experts leave idle can read the cache (the engine's `decode_threads`).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import CSRC, FLAGS, build, loads

SOURCE = CSRC / "paged_decode.c"
SYMBOL = "afserve_paged_decode"
KV_FORMATS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}   # cache dtype -> its KV_FMT
_loaded: set[torch.dtype] = set()
_threads = 1


def build_library(kv_dtype: torch.dtype = torch.float32, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The decode for caches of kv_dtype compiled (once per machine kind, source, format and flags) and loaded, its
    pool set to the process's threads. Raises BuildError naming the cause."""
    if kv_dtype not in KV_FORMATS:
        raise ValueError(f"kv_dtype={kv_dtype} has no C decode: use one of {list(KV_FORMATS)}")
    lib = build(SOURCE, FLAGS + (f"-DKV_FMT={KV_FORMATS[kv_dtype]}", *extra_flags))
    fn = getattr(lib, SYMBOL)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 11 + [ctypes.c_float, ctypes.c_int64]
    lib.afserve_set_threads.argtypes = [ctypes.c_int]
    lib.afserve_set_threads.restype = ctypes.c_int
    lib.afserve_set_threads(_threads)
    return lib


@functools.cache
def library(kv_dtype: torch.dtype = torch.float32) -> ctypes.CDLL:
    """The library this process uses for caches of kv_dtype (`build_library`, loaded once)."""
    lib = build_library(kv_dtype)
    _loaded.add(kv_dtype)
    return lib


def set_threads(n: int) -> int:
    """Threads the decode splits its sequences over from now on in this process (1: the calling thread alone;
    each format's library keeps a pool of n - 1 workers, started on first need) -> the number in use (capped at
    64). Calls with under 2048 context tokens in all run on the calling thread."""
    global _threads
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"decode threads={n!r} must be a positive int")
    _threads = library().afserve_set_threads(n)
    for kv_dtype in _loaded - {torch.float32}:
        library(kv_dtype).afserve_set_threads(n)
    return _threads


@functools.cache
def available() -> bool:
    """Whether the C kernels build and load here (asked once per process)."""
    return loads(library)


VECTOR = 8   # floats per vector in the C source (W): the head dims must be multiples of it


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this call can run in C: fp32 CPU queries over an fp32 or float8 cache, head dims a multiple of
    VECTOR, each cache's blocks one after another with its last dim contiguous (the engine's caches, and the MLA
    cache used as both K and V)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype in KV_FORMATS
            and k_cache.shape[-1] % VECTOR == 0 and v_cache.shape[-1] % VECTOR == 0
            and all(c.device.type == "cpu" and c.stride(-1) == 1 and c.stride(0) == c.shape[1] * c.stride(1)
                    for c in (k_cache, v_cache)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """As `paged_attention.paged_decode_attention_ref`: q `[B, h, dk]` -> `[B, h, dv]` fp32, for tensors that
    `supports` takes. One call into C for the whole batch; the block tables are read in place."""
    B, h, dk = q.shape
    _, bs, kvh, _ = k_cache.shape
    dv = v_cache.shape[-1]
    if k_cache.shape[-1] != dk or h % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}: the head dim must "
                         f"match and the query heads must be a multiple of the KV heads")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    sink = None if sinks is None else sinks.to(torch.float32).contiguous()
    out = q.new_empty(B, h, dv)
    if B == 0:
        return out
    rc = library(k_cache.dtype).afserve_paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        None if sink is None else sink.data_ptr(), out.data_ptr(), B, h, kvh, dk, dv, bs, tables.shape[1],
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), scale, window or 0)
    if rc != 0:
        raise MemoryError(f"paged decode: no memory for the scores of {B} sequences of up to "
                          f"{tables.shape[1] * bs} tokens")
    return out
