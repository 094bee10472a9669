"""The sync audit: counts, on a CPU run, the host syncs that a CUDA run of the same code would make.

A host sync is an op after which the host must wait for the device stream:
- a device-to-host read: `aten._local_scalar_dense` (`.item()`, `int(t)`, `float(t)`, `bool(t)`, `if t:`),
  ops that hand back a Python value read from the data (`torch.equal`, `torch.allclose`), and `.tolist()`,
  `.numpy()` and `.cpu()`. A CPU tensor is already on the host, so those three never reach the dispatcher:
  the audit wraps the `torch.Tensor` methods (on its own thread) while it is active. So does `bool(t)` under
  `torch.inference_mode()` (as the engine runs): there a CPU tensor's truth value is read below the dispatcher
  too (torch 2.13), so `__bool__` is wrapped as well, and runs with the dispatch modes off so that it counts once
  either way. Every call counts, also on a tensor that would be on the host in a CUDA run too; the site says
  which;
- an op whose output shape depends on the data (the host learns the size before it can allocate):
  PyTorch tags them `torch.Tag.dynamic_output_shape` (`nonzero`, `unique`, `masked_select`, `bincount`,
  `one_hot` ...) and the fake-tensor machinery raises on them. Two tagged ops are static for some arguments
  and count only when not: `aten.index.Tensor` with a bool (mask) index, and `aten.repeat_interleave.Tensor`
  without `output_size`. `index_put_` with a bool index (`t[mask] = v`) runs `nonzero` inside, so it
  counts too. Under `torch.inference_mode()` some composite ops reach the audit whole instead of as the ops they
  decompose into (`torch.where(mask)`, `argwhere`, `repeat_interleave` of self by a tensor, `linalg.solve`,
  `inv`, `cholesky` with their error checks): they are listed.

Not seen: a blocking host-to-device copy (`torch.tensor(..., device=d)`, `.to(d)` without `non_blocking`):
on a CPU run the rank's device is the host, so it cannot be told from a no-op. `torch.tensor([t0, t1])` of
0-dim tensors reads them below the dispatcher. `F.one_hot` checks its input's range with `.item()` on CPU
(not on CUDA), so it counts here where a CUDA run would not sync.

Each count goes to the first stack frame in this repository outside this module, "path/from/root.py:line".
`host_read(t)` is the one sanctioned read (the sampled ids on an attention rank); it counts like any other.
`SyncTally` keeps one rank's counts over steps; see docs/profiling.md ("Sync audit").
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
_HERE = os.path.abspath(__file__)
_aten = torch.ops.aten
# Ops returning a Python value read from the data that carry no data_dependent_output tag, and untagged ops that
# read the device inside: linalg's error check (`linalg.solve` and kin; `solve_ex` skips it), masked_scatter.
_SCALAR_READS = frozenset({_aten.equal.default, _aten.allclose.default, _aten._linalg_check_errors.default,
                           _aten.masked_scatter.default, _aten.masked_scatter_.default})
# Tagged dynamic_output_shape, but static unless an index is a mask.
_MASK_INDEXING = frozenset({_aten.index.Tensor})
# Untagged (the output has self's shape), but a mask index runs nonzero inside.
_MASK_PUTS = frozenset({_aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default})
# Composite ops that sync inside (nonzero, a scalar read). Outside inference mode the audit sees the ops they
# decompose into; under torch.inference_mode(), as the engine runs, it sees them whole.
_COMPOSITE_SYNCS = frozenset({_aten.where.default, _aten.argwhere.default, _aten.nonzero_numpy.default,
                              _aten.is_nonzero.default, _aten.linalg_solve.default, _aten.linalg_inv.default,
                              _aten.linalg_cholesky.default})
# Sized from the data unless output_size is given (the first also decomposes into the second).
_REPEATS = frozenset({_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor})
HOST_METHODS = ("tolist", "numpy", "cpu", "__bool__")   # reads that a CPU tensor may serve below the dispatcher


def host_read(t: torch.Tensor) -> list:
    """The sanctioned device-to-host read: `t` as (nested) Python lists. The audit counts it at the caller."""
    return t.tolist()


def cpu_numpy(t: torch.Tensor):
    """A CPU tensor's own memory as a numpy array, for CPU-only fast paths: no device is involved, so the audit
    does not count it (it calls the tensor's C method, under the audit's wrapper of `Tensor.numpy`). Raises for a
    tensor on any other device: read that through `host_read`, which is counted."""
    if t.device.type != "cpu":
        raise ValueError(f"cpu_numpy takes a CPU tensor, got one on {t.device}; use host_read for device data")
    return torch._C.TensorBase.numpy(t)


def _has_mask(indices) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def is_sync(func, args: tuple, kwargs: dict) -> bool:
    """Whether this aten op (with these arguments) makes a CUDA host wait for its stream."""
    if torch.Tag.data_dependent_output in func.tags or func in _SCALAR_READS or func in _COMPOSITE_SYNCS:
        return True
    if func in _MASK_INDEXING or func in _MASK_PUTS:
        return _has_mask(args[1] if len(args) > 1 else kwargs["indices"])
    if func in _REPEATS:
        return kwargs.get("output_size") is None
    return torch.Tag.dynamic_output_shape in func.tags


def caller_site(root: str = ROOT, skip: str = _HERE) -> str:
    """"path:line" of the innermost frame under `root` (relative to it) that is not in `skip` and not in an
    installed package; "<outside the repository>" when there is none."""
    frame = sys._getframe(1)
    prefix = root.rstrip(os.sep) + os.sep
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != skip and path.startswith(prefix) and "site-packages" not in path:
            return f"{os.path.relpath(path, root)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<outside the repository>"


@contextlib.contextmanager
def hooked_host_reads(hook: Callable[[str, str], None], root: str = ROOT, mark: bool = False):
    """Within the block, this thread's calls of the tensor methods that a CPU tensor serves below the dispatcher
    (HOST_METHODS) first call hook(method name, caller_site(root)); other threads' calls pass. mark: tag the
    wrappers as a SyncAudit's (audits do not nest). The methods are restored after the block."""
    thread = threading.get_ident()
    saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_METHODS}

    def wrap(name: str, method):
        def hooked(t, *args, **kwargs):
            if threading.get_ident() != thread:
                return method(t, *args, **kwargs)
            hook(name, caller_site(root))
            with _disable_current_modes():      # outside inference mode bool(t) dispatches: count it here only
                return method(t, *args, **kwargs)
        hooked.__sync_audit__ = mark
        return hooked
    for name in HOST_METHODS:
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:      # inherited from TensorBase: deleted again, not set on torch.Tensor
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


class SyncAudit(TorchDispatchMode):
    """While active (`with SyncAudit() as audit:`), counts this thread's host syncs by site:
    `audit.sites` {"path:line": count}. Not re-entrant: one audit at a time per process, since the wrapped
    `torch.Tensor` methods are the process's."""

    def __init__(self, root: str = ROOT):
        super().__init__()
        self.root = root
        self.sites: collections.Counter[str] = collections.Counter()
        self._reads = None

    @property
    def num_syncs(self) -> int:
        return sum(self.sites.values())

    def _count(self) -> None:
        self.sites[caller_site(self.root)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs):
            self._count()
        return func(*args, **kwargs)

    def __enter__(self) -> SyncAudit:
        if any(getattr(getattr(torch.Tensor, n), "__sync_audit__", False) for n in HOST_METHODS):
            raise RuntimeError("a SyncAudit is already active in this process; audits do not nest")
        self._reads = hooked_host_reads(lambda name, site: self.sites.update((site,)), self.root, mark=True)
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._reads.__exit__(None, None, None)
            self._reads = None


@dataclass(slots=True)
class SyncTally:
    """One rank's host syncs over its steps. Only decode steps are kept (a prefill step may sync: it is
    bounded by the prompt, not by every generated token): decode_steps, the most syncs one of them made, and
    the syncs per site summed over them."""

    decode_steps: int = 0
    max_per_decode_step: int = 0
    sites: collections.Counter = field(default_factory=collections.Counter)

    def run(self, step: Callable[[], object], is_decode: Callable[[], bool], root: str = ROOT):
        """step() under a SyncAudit; is_decode(), asked after it, says whether it was a decode step. Returns
        what step returned. A step that raises (a lost peer: it is run again) is not counted."""
        with SyncAudit(root) as audit:
            result = step()
        self.add(audit.sites, is_decode())
        return result

    def add(self, sites: collections.Counter, is_decode: bool) -> None:
        if not is_decode:
            return
        self.decode_steps += 1
        self.max_per_decode_step = max(self.max_per_decode_step, sum(sites.values()))
        self.sites.update(sites)

    def to_dict(self) -> dict:
        """{"decode_steps": n, "max_per_decode_step": k, "sites": {"path:line": count}} (sites most first)."""
        return {"decode_steps": self.decode_steps, "max_per_decode_step": self.max_per_decode_step,
                "sites": dict(self.sites.most_common())}
