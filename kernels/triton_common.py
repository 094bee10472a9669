"""What the Triton kernels share: the matmul step, its precision settings, and the launch checks.

Triton decides at import whether a kernel is compiled for the GPU or run by its CPU interpreter
(`TRITON_INTERPRET=1`, for tests); a kernel imported without the interpreter can only take CUDA tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, fp32. UPCAST: widen 16-bit operands to fp32 first (the interpreter multiplies bf16 bit
    patterns, triton-lang/triton#11584); PRECISION: "ieee" keeps fp32 inputs exact (no tf32)."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


def mma_flags(dtype: torch.dtype, interpreted: bool) -> dict:
    """The constexpr arguments of `mma` for operands of `dtype`."""
    return {"PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "UPCAST": interpreted and dtype == torch.bfloat16}


def check_launch(kernel, name: str, *tensors: torch.Tensor) -> bool:
    """Raise a clear error where `kernel` cannot take these tensors -> whether it runs interpreted."""
    interpreted = isinstance(kernel, InterpretedFunction)
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{name}: tensors on several devices {sorted(map(str, devices))}; move them to one")
    device = devices.pop()
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(f"{name}: the Triton kernels take CUDA tensors, not {device}. Use backend='torch' on "
                           f"CPU, or set TRITON_INTERPRET=1 before importing afserve to run Triton's interpreter")
    return interpreted


def float_dtype_ok(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: dtype {t.dtype} is not supported; pass float32, float16 or bfloat16")
