"""`no_host_reads()`: a block in which reading tensor values on the host raises, for tests of code on the decode
path (which must never wait on the device). It catches the reads by two independent routes:

- the Tensor methods that copy values out (`cpu`, `numpy`, `tolist`, `item`, and `bool`/`int`/`float`/index
  conversion), patched to raise: on CPU `tolist` and `numpy` do not go through the dispatcher, and `.cpu()` of a
  CPU tensor returns it untouched, so only a patch sees them;
- a TorchDispatchMode that raises on the aten ops that read a value on the host or give a shape that depends on
  the data (nonzero, unique, boolean-mask indexing, bincount sizing its output by the largest id, repeat_interleave
  by a tensor, linalg's error check), which on CUDA would each wait on the device.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::masked_scatter",
               "aten::unique_dim", "aten::_unique", "aten::_unique2", "aten::unique_consecutive",
               "aten::unique_dim_consecutive", "aten::bincount", "aten::_linalg_check_errors", "aten::item"}
READ_METHODS = ("cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__")


class HostRead(AssertionError):
    pass


class _Audit(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        overload = func._overloadname
        if name in SYNCING_OPS:
            raise HostRead(f"{func} reads the device on the host")
        if name == "aten::repeat_interleave" and overload in ("Tensor", "self_Tensor") \
                and kwargs.get("output_size") is None:
            raise HostRead(f"{func} without output_size sizes its output from the data")
        if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise HostRead(f"{func} with a boolean mask has a shape that depends on the data")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_reads():
    """Within the block, any host read of tensor values raises HostRead."""
    # a method that torch.Tensor inherits (from TensorBase) is deleted again afterwards, not set on torch.Tensor
    saved = {m: torch.Tensor.__dict__.get(m) for m in READ_METHODS}

    def refuse(method):
        def raise_(self, *args, **kwargs):
            raise HostRead(f"Tensor.{method}() reads the device on the host")
        return raise_

    try:
        for m in READ_METHODS:
            setattr(torch.Tensor, m, refuse(m))
        with _Audit():
            yield
    finally:
        for m, f in saved.items():
            if f is None:
                delattr(torch.Tensor, m)
            else:
                setattr(torch.Tensor, m, f)
