"""Start-up calibration of the alpha-beta cost model for comm=auto: time real layers, then fit.

Every rank builds a `direct` and a `two_phase` dispatcher on the data-plane group and runs a few layers of
each (synthetic tokens, identity experts) at a few capacities; a layer's time is the slowest rank's. The
model is fitted to those layers (cost_model.fit_layers), once with one inter-node port per rank and once
with a node's ranks sharing one, and the better fit is kept, so the calibration also finds out whether the
ranks of a node share their network port. Fitting what the modes actually do, instead of a ping-pong
between two ranks, prices in what a ping-pong misses: the ranks' own per-hop work and ports shared by
several flows. All ranks then hold rank 0's model, so they make the same choice on every call.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from .cost_model import CostModel, fit_port_sharing
from .dispatcher import Dispatcher
from .modes import make_dispatcher

CAPACITIES = (8, 32, 128, 512)      # tokens per attention rank; and the largest the engine will use
REPEATS = 11
LARGE_REPEATS = 5                   # above 512 tokens a layer is long enough to need fewer
SLOTS_PER_RANK = 8


def layers_per_repeat(tokens: int) -> int:
    """Layers timed back to back per repeat: enough that the tiniest layers are not all timer and barrier, few
    at larger sizes so that many repeats fit. On a busy host a repeat's spread is ~20% and bursts of slow ones
    come in runs, so a median needs many short repeats more than a few long ones (with 5 repeats of 2 layers
    the calibration once over-predicted every layer of a run by 30-45%)."""
    return 8 if tokens <= 32 else 2 if tokens <= 256 else 1


def synthetic_tokens(d: Dispatcher, capacity: int, seed: int):
    """`capacity` tokens of this source, each to top_k slots drawn uniformly over the expert ranks."""
    if not d.is_source:
        return d.empty_tokens()
    g = torch.Generator().manual_seed(seed * 7919 + d.rank)
    E, K = d.world_size - d.num_sources, d.top_k
    virtual = torch.rand(capacity, E * SLOTS_PER_RANK, generator=g).argsort(dim=1)[:, :K]
    hidden = torch.randn(capacity, d.hidden_size, generator=g).to(d.dtype).to(d.device)
    return (hidden, (d.num_sources + virtual // SLOTS_PER_RANK).to(d.device), (virtual % SLOTS_PER_RANK).to(d.device),
            torch.rand(capacity, K, generator=g).to(d.device))


def time_layers(modes: dict[str, Dispatcher], capacity: int, repeats: int, layers: int = 2,
                seed: int = 0) -> dict[str, list[float]]:
    """Seconds per layer (dispatch, identity experts, combine) of each mode, `repeats` times, the slowest rank's
    figure each time; the modes take turns inside a repeat. A collective: every rank calls it alike."""
    names = list(modes)
    group = next(iter(modes.values())).group
    inputs = {m: synthetic_tokens(d, capacity, seed) for m, d in modes.items()}
    times = {m: [] for m in names}
    for d in modes.values():
        d.set_capacity(capacity)
    for rep in range(repeats + 1):                  # the first round warms the connections up
        for m in names[rep % len(names):] + names[:rep % len(names)]:
            d = modes[m]
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for i in range(layers):
                rows, handle = d.dispatch(i, *inputs[m])
                d.combine(rows.hidden, handle)
            if d.device.type == "cuda":      # the layers' kernels must have run before the timer stops
                torch.cuda.synchronize(d.device)
            if rep:
                times[m].append((time.perf_counter() - t0) / layers)
    t = torch.tensor([times[m] for m in names], dtype=torch.float64, device=modes[names[0]].device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, t.tolist()))


def calibrate(max_tokens: int | None = None, repeats: int = REPEATS, **dispatcher_kw) -> CostModel:
    """Measure and fit (every rank calls it with the same arguments): layers at CAPACITIES up to max_tokens
    (the most tokens an attention rank will send in one call) and at max_tokens itself, so the fit sees the
    regime the engine will run in. dispatcher_kw: as for make_dispatcher."""
    modes = {m: make_dispatcher(m, **dispatcher_kw) for m in ("direct", "two_phase")}
    d = modes["direct"]
    top = max_tokens or CAPACITIES[-1]
    samples = []
    for C in sorted({c for c in CAPACITIES if c <= top} | {top}):
        for m, ts in time_layers(modes, C, repeats if C <= 512 else LARGE_REPEATS, layers_per_repeat(C)).items():
            samples.append((modes[m].planned_messages(C), d.node_of, statistics.median(ts)))
    return _from_rank0(fit_port_sharing(samples, d.ranks_per_node), d.group, d.device)


def _from_rank0(model: CostModel | None, group, device) -> CostModel:
    t = model.as_tensor().to(device) if model is not None else torch.zeros(5, dtype=torch.float64, device=device)
    dist.broadcast(t, src=0, group=group)
    return CostModel.from_tensor(t.cpu())


def shared_model(path: str | None = None, max_tokens: int | None = None, **dispatcher_kw) -> CostModel:
    """The model every rank uses: rank 0 loads `path` when it exists, else every rank joins a calibration
    (and rank 0 saves it to `path` when given). Rank 0's model is broadcast, so all ranks agree."""
    group, device = dispatcher_kw["group"], dispatcher_kw["device"]
    me = dist.get_rank(group)
    loaded, problem = None, None
    if me == 0 and path is not None and os.path.exists(path):
        try:
            loaded = CostModel.load(path)
        except ValueError as e:
            problem = e
    # 0: measure, 1: rank 0 loaded the file, 2: the file is unreadable (every rank raises, none hangs)
    state = torch.tensor([2 if problem is not None else 1 if loaded is not None else 0], device=device)
    dist.broadcast(state, src=0, group=group)
    if int(state) == 2:
        raise problem if problem is not None else ValueError(f"rank 0 could not read the comm calibration {path!r}")
    if int(state) == 1:
        return _from_rank0(loaded, group, device)
    model = calibrate(max_tokens, **dispatcher_kw)
    if me == 0 and path is not None:
        model.save(path)
    return model
