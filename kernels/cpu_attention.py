"""Paged decode attention in C for the CPU: reads each sequence's K/V blocks where they lie in the cache, where the
sdpa backend gathers a copy of them first (decode attention is memory-bound, so the copy costs about as much as
the attention). The source is kernels/csrc/paged_decode.c; it is compiled with the system C compiler on first use
(about a second) into a cache directory and loaded with ctypes. Only fp32 caches on the CPU take it; anything
else, and prefill, go to the sdpa backend. A call can split its sequences over a few threads of the library's
own (`set_threads`): on a CPU, attention ranks are busy while the expert ranks wait, so the cores the experts
leave idle can read the cache (the engine's `decode_threads`).

The build is keyed by the source, the flags, the compiler and the CPU's feature flags (it uses -march=native), so
a cache directory shared by different machines keeps one library per machine kind. Ranks starting together may
compile at once: each writes its own temporary file and renames it into place.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")
SYMBOL = "afserve_paged_decode_f32"


class BuildError(RuntimeError):
    """The C kernels could not be compiled or loaded; the message says why and what to do."""


def cache_dir() -> Path:
    """Where built libraries go: $AFSERVE_CACHE_DIR, else $XDG_CACHE_HOME/afserve, else ~/.cache/afserve."""
    if os.environ.get("AFSERVE_CACHE_DIR"):
        return Path(os.environ["AFSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "afserve"


def _compiler() -> list[str]:
    """The compiler command: $CC (split like a shell word list, e.g. "ccache gcc"), else cc, gcc or clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise BuildError("kernel backend 'cpu' needs a C compiler (cc, gcc or clang on PATH, or $CC); install one "
                         "or use kernel_backend='sdpa'")
    return [cc]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@functools.cache
def library() -> ctypes.CDLL:
    """The built library (compiled once per machine kind and source). Raises BuildError naming the cause."""
    cc = _compiler()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"kernel backend 'cpu': the C compiler {' '.join(cc)!r} does not run ({e}); set $CC or "
                         f"use kernel_backend='sdpa'") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_flags()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"paged_decode-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            try:
                done = subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm", "-lpthread"], capture_output=True,
                                      text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise BuildError(f"kernel backend 'cpu': compiling {SOURCE} failed ({e}); use kernel_backend='sdpa' "
                                 f"instead") from e
            if done.returncode != 0:
                raise BuildError(f"kernel backend 'cpu': compiling {SOURCE} with {' '.join(cc)} failed:\n"
                                 f"{done.stderr[-2000:]}\nuse kernel_backend='sdpa' instead")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    fn = getattr(lib, SYMBOL)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 11 + [ctypes.c_float, ctypes.c_int64]
    lib.afserve_set_threads.argtypes = [ctypes.c_int]
    lib.afserve_set_threads.restype = ctypes.c_int
    return lib


def set_threads(n: int) -> int:
    """Threads the decode splits its sequences over from now on in this process (1: the calling thread alone;
    the library keeps a pool of n - 1 workers, started on first need) -> the number in use (capped at 64).
    Calls with under 2048 context tokens in all run on the calling thread."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"decode threads={n!r} must be a positive int")
    return library().afserve_set_threads(n)


@functools.cache
def available() -> bool:
    """Whether the C kernels build and load here (asked once per process)."""
    try:
        library()
    except (BuildError, OSError):
        return False
    return True


VECTOR = 8   # floats per vector in the C source (W): the head dims must be multiples of it


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this call can run in C: fp32 CPU tensors, head dims a multiple of VECTOR, each cache's blocks one
    after another with its last dim contiguous (the engine's caches, and the MLA cache used as both K and V)."""
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
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
    rc = library().afserve_paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        None if sink is None else sink.data_ptr(), out.data_ptr(), B, h, kvh, dk, dv, bs, tables.shape[1],
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), scale, window or 0)
    if rc != 0:
        raise MemoryError(f"paged decode: no memory for the scores of {B} sequences of up to "
                          f"{tables.shape[1] * bs} tokens")
    return out
