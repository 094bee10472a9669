"""Compile the Triton kernels for a GPU on a machine without one, and read what the compiler made of them.

The wrappers in `triton_attention` / `triton_moe` run on CPU tensors with their kernels swapped for recorders,
so each launch is captured exactly as the wrapper makes it (arguments, constexprs, warps, stages). Each is then
compiled by Triton's own compiler and the ptxas that ships with Triton for a CUDA target (default sm_90, the
H100/H200), and `cuobjdump` reports its registers, stack (spilled registers), shared memory, and whether its
matmuls became Hopper `wgmma` instructions. Ints divisible by 16 and every pointer get Triton's 16-divisibility
hint, as a real launch would. Run it with the interpreter off:

    python -m kernels.aot [--arch 90]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64"}
OPTIONS = ("num_warps", "num_stages")


@dataclass(slots=True)
class Launch:
    """One kernel launch as a wrapper made it."""

    name: str
    fn: object        # the JITFunction
    args: tuple
    kwargs: dict
    case: str = ""    # what the wrapper was asked to do


@dataclass(slots=True)
class Compiled:
    """What the compiler made of one launch."""

    name: str
    case: str
    constexprs: dict
    registers: int
    stack_bytes: int  # > 0: registers spilled to local memory
    shared_bytes: int
    wgmma: int        # wgmma.mma_async instructions in the PTX


class _Recorder:
    def __init__(self, name: str, fn, log: list[Launch]):
        self.name, self.fn, self.log = name, fn, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(Launch(self.name, self.fn, args, kwargs))


@contextlib.contextmanager
def recording(log: list[Launch]):
    """Swap every `_*_kernel` of the Triton modules for a recorder, and let CPU tensors through."""
    from . import triton_attention, triton_moe
    saved = []
    for mod in (triton_attention, triton_moe):
        for name in [n for n in vars(mod) if n.startswith("_") and n.endswith("_kernel")]:
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, _Recorder(name, getattr(mod, name), log))
        saved.append((mod, "check_launch", mod.check_launch))
        mod.check_launch = lambda *a: False
    try:
        yield log
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def _signature(launch: Launch) -> tuple[dict, dict, dict, dict]:
    """-> (signature, constexprs, divisibility attrs, options) for triton's ASTSource and compile."""
    fn = launch.fn
    values = dict(zip(fn.arg_names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k not in OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, {k: launch.kwargs[k] for k in OPTIONS if k in launch.kwargs}


def _cuobjdump() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_launch(launch: Launch, arch: int = 90) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, constexprs, attrs, options = _signature(launch)
    kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                            options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    field = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", usage)}
    return Compiled(launch.name, launch.case, constexprs, field["REG"], field["STACK"],
                    field["SHARED"] + kernel.metadata.shared, kernel.asm["ptx"].count("wgmma.mma_async"))


def launches() -> list[Launch]:
    """The launches of every wrapper, recorded on small CPU tensors: bf16 and fp32 attention at head dim 128 with
    GQA 8 (decode in one partition and split, prefill), fused MoE at bf16 tile heights 16, 64, 128 and fp32."""
    from . import triton_attention as ta
    from . import triton_moe as tm
    log: list[Launch] = []

    def record(case, wrapper, *args, **kwargs):
        start = len(log)
        wrapper(*args, **kwargs)
        for launch in log[start:]:
            launch.case = case

    with recording(log):
        for dtype in (torch.bfloat16, torch.float32):
            name = TYPES[dtype]
            kc = torch.zeros(64, 16, 4, 128, dtype=dtype)
            tables = torch.zeros(8, 4, dtype=torch.int32)
            lens = torch.full((8,), 64, dtype=torch.int32)
            q = torch.zeros(8, 32, 128, dtype=dtype)
            record(f"{name} write_kv", ta.write_kv, kc, kc, q[:, :4], q[:, :4], torch.zeros(8, dtype=torch.int64))
            record(f"{name} decode", ta.paged_decode_attention, q, kc, kc, tables, lens, 0.1, max_context_len=64)
            record(f"{name} decode split", ta.paged_decode_attention, q, kc, kc, tables, lens, 0.1,
                   max_context_len=64, partition_size=32)
            record(f"{name} prefill", ta.paged_prefill_attention, q, kc, kc, tables,
                   torch.arange(9, dtype=torch.int32), lens, 0.1)
        for dtype, N in ((torch.bfloat16, 16), (torch.bfloat16, 128), (torch.bfloat16, 1024), (torch.float32, 64)):
            x = torch.zeros(N, 256, dtype=dtype)
            slots = torch.zeros(N, 8, dtype=torch.int64)
            record(f"{TYPES[dtype]} fused_moe {N}x8 pairs on 8 slots", tm.fused_moe, x, slots, torch.zeros(N, 8),
                   torch.zeros(8, 128, 256, dtype=dtype), torch.zeros(8, 256, 64, dtype=dtype))
    return log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernels.aot: unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    print(f"{'case':<40} {'kernel':<24} {'regs':>5} {'stack B':>8} {'shared B':>9} {'wgmma':>6}")
    rows = []
    for launch in launches():
        c = compile_launch(launch, args.arch)
        print(f"{c.case:<40} {c.name:<24} {c.registers:>5} {c.stack_bytes:>8} {c.shared_bytes:>9} {c.wgmma:>6}")
        rows.append({f: getattr(c, f) for f in c.__slots__})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
