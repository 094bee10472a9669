"""comm/sync_audit.py: which ops count as host syncs, where they are attributed, and one rank's tally."""
from __future__ import annotations

import collections
import contextlib
import os
import threading

import pytest
import torch

from comm.sync_audit import ROOT, SyncAudit, SyncTally, cpu_numpy, host_read

HERE = os.path.relpath(os.path.abspath(__file__), ROOT)


def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(6, dtype=torch.float32)
    return x, x > 2


# One per line: the audit must name the lambda's own line.
SYNCS = {
    "item": lambda x, m: x[0].item(),
    "int": lambda x, m: int(x.argmax()),
    "bool": lambda x, m: bool((x > 4).any()),
    "tolist": lambda x, m: x.tolist(),
    "cpu": lambda x, m: x.cpu(),
    "numpy": lambda x, m: x.numpy(),
    "host_read": lambda x, m: host_read(x),
    "equal": lambda x, m: torch.equal(x, x),
    "nonzero": lambda x, m: m.nonzero(),
    "float": lambda x, m: float(x.sum()),
    "index": lambda x, m: [0, 1, 2][x.argmax() % 3],
    "where": lambda x, m: torch.where(m),
    "argwhere": lambda x, m: torch.argwhere(m),
    "nonzero_tuple": lambda x, m: m.nonzero(as_tuple=True),
    "if": lambda x, m: 1 if x.sum() else 0,
    "unique": lambda x, m: torch.unique(x),
    "unique_consecutive": lambda x, m: torch.unique_consecutive(x),
    "unique_dim": lambda x, m: torch.unique(x.view(2, 3), dim=0),
    "bool_mask": lambda x, m: x[m],
    "masked_select": lambda x, m: x.masked_select(m),
    "bool_mask_put": lambda x, m: x.__setitem__(m, 0.0),
    "repeat_interleave": lambda x, m: torch.repeat_interleave(torch.tensor([1, 2])),
    "repeat_interleave_self": lambda x, m: x.repeat_interleave(torch.tensor([1, 0, 2, 1, 1, 1])),
    "bincount": lambda x, m: torch.bincount(torch.tensor([1, 3])),
    "linalg_solve": lambda x, m: torch.linalg.solve(torch.eye(2) * 2, torch.ones(2)),
    "linalg_inv": lambda x, m: torch.linalg.inv(torch.eye(2) * 2),
    "masked_scatter": lambda x, m: x.masked_scatter(m, torch.ones(6)),
}

PLAIN = {
    "matmul": lambda x, m: x @ x,
    "index_select": lambda x, m: x.index_select(0, torch.tensor([0, 3])),
    "int_index": lambda x, m: x[torch.tensor([0, 3])],
    "int_index_put": lambda x, m: x.__setitem__(torch.tensor([0, 3]), 1.0),
    "repeat_interleave_sized": lambda x, m: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3),
    "repeat_interleave_int": lambda x, m: x.repeat_interleave(2),
    "repeat_interleave_self_sized": lambda x, m: x.repeat_interleave(torch.tensor([1, 0, 2, 1, 1, 1]), output_size=6),
    "nonzero_static": lambda x, m: torch.nonzero_static(m, size=6),
    "masked_fill": lambda x, m: x.masked_fill(m, 0.0),
    "where3": lambda x, m: torch.where(m, x, -x),
    "argmax_sort_topk": lambda x, m: (x.argmax(), x.sort(), x.topk(2)),
    "to_dtype": lambda x, m: x.to(torch.float64),
    "cpu_numpy": lambda x, m: cpu_numpy(x),        # a CPU-only fast path's view of its own memory
    "linalg_solve_ex": lambda x, m: torch.linalg.solve_ex(torch.eye(2) * 2, torch.ones(2)),
}


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("name", list(SYNCS))
def test_each_sync_counts_once_at_its_line(name, inference):
    """Also under torch.inference_mode(), as the engine runs its steps: there bool(t) of a CPU tensor is read below
    the dispatcher (torch 2.13), and only the audit's wrapper of Tensor.__bool__ sees it."""
    fn = SYNCS[name]
    x, m = make_inputs()
    with torch.inference_mode() if inference else contextlib.nullcontext(), SyncAudit() as audit:
        fn(x, m)
    assert dict(audit.sites) == {f"{HERE}:{fn.__code__.co_firstlineno}": 1}


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_ops_do_not_count(name, inference):
    x, m = make_inputs()
    with torch.inference_mode() if inference else contextlib.nullcontext(), SyncAudit() as audit:
        PLAIN[name](x, m)
    assert audit.num_syncs == 0, audit.sites


def test_cpu_numpy_is_the_tensors_memory_and_refuses_other_devices():
    x, _ = make_inputs()
    view = cpu_numpy(x)
    view[0] = 42.0
    assert x[0] == 42.0
    with pytest.raises(ValueError, match="use host_read"):
        cpu_numpy(x.to("meta"))


def test_methods_are_restored_and_other_threads_not_counted():
    x, _ = make_inputs()
    originals = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy", "cpu", "__bool__")}
    with SyncAudit() as audit:
        worker = threading.Thread(target=lambda: (x.tolist(), x.cpu(), x.numpy(), bool(x[0])))
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError, match="do not nest"), SyncAudit():
            pass
    assert audit.num_syncs == 0
    assert {n: getattr(torch.Tensor, n) for n in originals} == originals
    assert "tolist" not in torch.Tensor.__dict__ and "__bool__" not in torch.Tensor.__dict__
    with SyncAudit() as audit:   # a second audit in the same process works the same
        x.tolist()
    assert audit.num_syncs == 1


def test_the_site_is_the_first_frame_in_the_repository(tmp_path):
    """A frame outside the root (here: a module in tmp_path) is skipped for the caller inside it."""
    outside = tmp_path / "elsewhere.py"
    outside.write_text("def read(t):\n    return t.tolist()\n")
    ns: dict = {}
    exec(compile(outside.read_text(), str(outside), "exec"), ns)
    x, _ = make_inputs()
    with SyncAudit() as audit:
        read_through(ns["read"], x)
    assert dict(audit.sites) == {f"{HERE}:{read_through.__code__.co_firstlineno + 1}": 1}
    with SyncAudit(root=str(tmp_path)) as audit:   # rooted there instead: the read is inside
        ns["read"](x)
    assert dict(audit.sites) == {"elsewhere.py:2": 1}


def read_through(read, x):
    return read(x)      # the innermost frame in the repository: the audit names this line


def test_tally_keeps_decode_steps_only():
    x, m = make_inputs()
    tally = SyncTally()

    def step(n):
        for _ in range(n):
            x.tolist()
        return n
    assert tally.run(lambda: step(5), lambda: False) == 5        # prefill: not kept
    assert tally.run(lambda: step(2), lambda: True) == 2
    assert tally.run(lambda: step(3), lambda: True) == 3
    tally.run(lambda: m.nonzero(), lambda: True)
    with pytest.raises(ZeroDivisionError):                        # a failed step is not counted
        tally.run(lambda: 1 / 0, lambda: True)
    report = tally.to_dict()
    assert report["decode_steps"] == 3 and report["max_per_decode_step"] == 3
    sites = collections.Counter({k.split(":")[0]: v for k, v in report["sites"].items()})
    assert sum(report["sites"].values()) == 6 and set(sites) == {HERE}
    assert list(report["sites"].values()) == sorted(report["sites"].values(), reverse=True)
