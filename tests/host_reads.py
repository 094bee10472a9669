"""`no_host_reads()`: a block in which reading tensor values on the host raises, for tests of code on the decode
path (which must never wait on the device). It refuses exactly what the engine's sync audit counts
(comm/sync_audit.py): the aten ops that read a value on the host or give a shape that depends on the data
(`is_sync`), and the Tensor methods that a CPU tensor may serve below the dispatcher (`tolist`, `numpy`, `cpu`,
`bool`; `hooked_host_reads`, on this thread), so the tests' check and the audit cannot drift apart.
"""
from __future__ import annotations

import contextlib
import os

from torch.utils._python_dispatch import TorchDispatchMode

from comm.sync_audit import caller_site, hooked_host_reads, is_sync

_HERE = os.path.abspath(__file__)


class HostRead(AssertionError):
    pass


class _Refuse(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs):
            raise HostRead(f"{func} reads the device on the host at {caller_site(skip=_HERE)}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_reads():
    """Within the block, any host read of tensor values on this thread raises HostRead."""
    def refuse(name: str, site: str) -> None:
        raise HostRead(f"Tensor.{name}() reads the device on the host at {site}")
    with hooked_host_reads(refuse), _Refuse():
        yield
