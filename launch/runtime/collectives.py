"""The collectives every rank joins between steps, when the leader's header asks for them
(launch/runtime/step_protocol.py): live re-placement of the experts, and gathering every rank's stats."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from balancer.drift import incremental_replan
from balancer.placement import expert_load, load_balance, step_balance
from balancer.replan import plan_rebalance
from comm.control import ControlPlane
from comm.dispatcher import Dispatcher
from comm.sync_audit import SyncTally
from comm.topology import ProcessGroups, Topology

from ..config import ParallelConfig
from .planning import PlacementState

logger = logging.getLogger("afserve")
DRIFT_THRESHOLD = 1.10    # incremental re-placement: the predicted max/mean above which a layer's slots move


def rebalance(topo: Topology, groups: ProcessGroups, worker, state: PlacementState, num_experts: int,
              max_slots: int = 0) -> None:
    """Live re-placement, on every rank at once: gather what each expert slot served since the last one, fold
    it into the load EMA, recompute the placement (every rank gets the same answer: EPLB from scratch, or with
    max_slots at most that many slot moves per layer on the layers predicted above 1.10 max/mean,
    balancer/drift.py), move the expert weights that change rank with send/recv, and adopt the new placement.
    worker: this rank's AttentionWorker or ExpertWorker."""
    A = topo.num_attention_ranks
    L, S = state.placement.num_layers, state.placement.num_slots
    mine = torch.zeros(L, S, dtype=torch.int64) if topo.is_attention else worker.load.take_slot_counts()
    every = [torch.empty_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(every, mine, group=groups.control)
    counts = torch.stack(every[A:], dim=1)                                       # [L, n, S]
    observed = expert_load(state.placement.slot2expert, counts, num_experts)
    if float(observed.sum()) == 0:
        return
    state.load_ema = observed if state.load_ema is None else 0.5 * state.load_ema + 0.5 * observed
    replan = incremental_replan(state.placement, state.load_ema, max_slots, state.capacity, DRIFT_THRESHOLD) \
        if max_slots else plan_rebalance(state.placement, state.load_ema, state.capacity, state.rank_node)
    if torch.equal(replan.placement.slot2expert, state.placement.slot2expert):
        return
    state.placement = replan.placement
    if topo.is_attention:
        worker.set_placement(state.placement)
    else:
        row = state.placement.slot2expert[:, topo.expert_index]
        state.num_slots_moved += worker.move_experts(replan.moves, row, topo.expert_index, lambda r: A + r,
                                                     groups.world)
    state.num_replacements += 1
    logger.info("rank %d: re-placement %d, %d slot copies", topo.rank, state.num_replacements, len(replan.moves))


def gather_stats(topo: Topology, control: ControlPlane, dispatcher: Dispatcher, worker, state: PlacementState,
                 par: ParallelConfig, kernel_backend: str, events: bool = False,
                 sync_tally: SyncTally | None = None) -> dict | None:
    """Every rank's comm stats and load history (and with `events` its recent calls), and its sync audit
    (host_syncs: None when off) to the leader -> the merged dict there, None elsewhere."""
    stats = dispatcher.stats
    mine = {"rank": topo.rank, "role": topo.role, "node": topo.node_of(topo.rank), "kernel_backend": kernel_backend,
            "layers": stats.to_dict(), "compute": stats.compute_dict(),
            "host_syncs": None if sync_tally is None else sync_tally.to_dict()}
    if events:
        mine["events"] = stats.events_list()
    if topo.is_attention:
        mine["steps"] = stats.steps_dict()
        graphs = worker.model.graphs
        mine["graphs"] = None if graphs is None else graphs.stats()
    else:
        mine["step_loads"] = worker.load.step_loads().tolist()
        mine["slots_moved"] = state.num_slots_moved
    every = control.gather_objects(mine)
    if every is None:
        return None
    loads = [torch.tensor(r["step_loads"], dtype=torch.int64) for r in every if "step_loads" in r]
    steps = min(t.shape[0] for t in loads)
    L = state.placement.num_layers
    stacked = torch.stack([t[t.shape[0] - steps:].reshape(steps, L) for t in loads])     # [n, steps, L]
    balance = load_balance(stacked)
    by_step = step_balance(stacked)                                                      # [steps, L]
    totals = stacked.sum(dim=1)                                                          # [n, L]
    return {"comm": par.comm, "comm_mode": dispatcher.describe(),
            "balancer": par.balancer, "redundant_experts": par.redundant_experts,
            "replacements": state.num_replacements,
            "slots_moved": sum(r.get("slots_moved", 0) for r in every),
            "ranks": {str(r["rank"]): {k: r[k] for k in ("role", "node", "kernel_backend", "layers", "compute",
                                                         "steps", "events", "host_syncs", "graphs") if k in r}
                      for r in every},
            "expert_load": {"steps": steps, "layers": {str(layer): {
                "max_mean": balance[layer], "pairs_per_rank": totals[:, layer].tolist(),
                "max_mean_by_step": by_step[:, layer].tolist()} for layer in range(L)}}}
