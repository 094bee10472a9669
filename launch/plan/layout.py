"""The two terms of a plan's step that depend on where its ranks sit and its experts live: the dispatch and combine
of a plan that spans nodes or uses two_phase, and the expert pool's load imbalance.

Comm. On one node with comm='direct' the engine exchanges through the same-host inboxes (shm), whose cost the
step-cost calibration measured (c0 + c_tok * T). Any other plan (several nodes, or two_phase) runs the comm mode
over the collective transport; its dispatch + combine per MoE layer and micro-batch is what comm/cost_model.py's
alpha-beta model predicts for the mode's own planned messages (the dispatcher built on a Layout, as
launch/comm_profile.py's --simulate does) at the step's capacity: the most tokens an attention rank runs in it, or
the token budget in a step that admits requests (the engine's header capacity).
That model comes from the engine's own comm calibration (comm=auto with comm_calibration=FILE writes it, timing
real layers of both modes on the job's ranks) or, at cluster scale, from a GPU's link figures (`links_model`).

Experts. The step model otherwise takes every expert rank's (token, expert) pairs as equal. Given the workload's
per-expert load (a Zipf exponent or observed counts), a plan's expert ranks hold EPLB's placement of
num_experts + redundant_experts slots for that load (what live re-placement, rebalance_interval, converges to),
each expert's load split evenly over its replicas (the least_loaded balancer's aim); the busiest rank's share over
the mean (balancer/drift.py's imbalance) scales the expert compute. Redundant slots also cost their weights'
read per layer (e_all) and memory.
"""
from __future__ import annotations

import functools
import json
import math

import torch

from comm.cost_model import CostModel, LinkCost

DTYPES = {4: torch.float32, 2: torch.bfloat16, 1: torch.float8_e4m3fn}


def links_model(link_bytes_s: float, link_latency_s: float, nic_bytes_s: float, nic_latency_s: float) -> CostModel:
    """The alpha-beta model of a GPU's links: NVLink within a node, the NIC (one per GPU) between nodes."""
    return CostModel(LinkCost(link_latency_s, 1 / link_bytes_s), LinkCost(nic_latency_s, 1 / nic_bytes_s))


def load_network(path: str) -> dict:
    """A comm calibration JSON (CostModel.save, or comm=auto's comm_calibration file) -> its dict, checked."""
    return CostModel.load(path).to_dict()


@functools.lru_cache(maxsize=65536)
def _layer_s(network: str, comm: str, attention: int, experts: int, ranks_per_node: int, hidden: int, top_k: int,
             dtype_bytes: int, capacity: int) -> float:
    from comm.dispatcher import Layout
    from comm.modes import make_dispatcher

    model = CostModel.from_dict(json.loads(network))
    W = attention + experts
    d = make_dispatcher(comm, group=Layout(W), hidden_size=hidden, top_k=top_k, dtype=DTYPES[dtype_bytes],
                        device=torch.device("cpu"), num_sources=attention, ranks_per_node=ranks_per_node)
    return model.layer_time(d.planned_messages(capacity), d.node_of)


def comm_layer_s(network: dict, comm: str, attention: int, experts: int, ranks_per_node: int, hidden: int,
                 top_k: int, dtype_bytes: int, capacity: int) -> float:
    """Dispatch + combine seconds of one MoE layer under the network model, every attention rank sending up to
    `capacity` tokens (the mode's padded messages, as the engine sends them)."""
    if dtype_bytes not in DTYPES or hidden < 1:
        raise ValueError(f"comm pricing needs the model's hidden size and dispatch dtype bytes (1, 2 or 4); the "
                         f"step costs have hidden={hidden}, dtype_bytes={dtype_bytes}: re-run --calibrate")
    return _layer_s(json.dumps(network, sort_keys=True), comm, attention, experts, ranks_per_node, hidden, top_k,
                    dtype_bytes, max(1, capacity))


def parse_expert_load(text: str, num_experts: int, top_k: int) -> list[list[float]]:
    """--expert-load: 'zipf:S' (expert i's share of the (token, expert) pairs proportional to 1 / (i + 1)^S, each
    share at most 1 / top_k, since a token picks top_k distinct experts) or a JSON file of per-expert counts,
    one layer `[E]` or every MoE layer `[L][E]` -> `[L][E]` loads."""
    if num_experts < 1:
        raise ValueError(f"--expert-load {text!r}: the step costs do not say how many experts the model has (a "
                         "profile saved before they did): re-run --calibrate")
    if text.startswith("zipf:"):
        try:
            s = float(text[5:])
        except ValueError:
            s = math.nan
        if not (s >= 0 and math.isfinite(s)):
            raise ValueError(f"--expert-load {text!r}: give zipf:S with S >= 0 (0: uniform), or a JSON file")
        return [_capped([1 / (i + 1) ** s for i in range(num_experts)], 1 / top_k)]
    try:
        with open(text) as f:
            load = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--expert-load {text!r}: not zipf:S nor a readable JSON file ({e})") from e
    rows = load if isinstance(load, list) and load and all(isinstance(r, list) for r in load) else [load]

    def count(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if not all(isinstance(r, list) and len(r) == num_experts and all(map(count, r)) and sum(r) > 0 for r in rows):
        raise ValueError(f"--expert-load {text!r}: give a list of {num_experts} finite counts >= 0 (not all zero), "
                         "or one such list per MoE layer")
    return [[float(v) for v in r] for r in rows]


def _capped(weights: list[float], cap: float) -> list[float]:
    """Normalise to shares summing to 1 with none above cap: the excess of a capped share goes to the others
    in proportion (water-filling)."""
    share = [w / sum(weights) for w in weights]
    for _ in range(len(share)):
        over = [i for i, v in enumerate(share) if v > cap + 1e-12]
        if not over:
            break
        free = [i for i, v in enumerate(share) if v < cap - 1e-12]
        excess = sum(share[i] - cap for i in over)
        for i in over:
            share[i] = cap
        room = sum(share[i] for i in free)
        for i in free:
            share[i] += excess * share[i] / room
    return share


def expert_imbalance(load: list[list[float]] | None, num_experts: int, expert_ranks: int,
                     redundant_experts: int) -> float:
    """The busiest expert rank's pairs over the mean, averaged over the layers, under EPLB's placement for the
    load (1.0 without a load: balanced)."""
    if load is None:
        return 1.0
    from balancer.drift import imbalance
    from balancer.placement import eplb, slot_capacities

    t = torch.tensor(load, dtype=torch.float64)
    placement = eplb(t, slot_capacities(num_experts, redundant_experts, expert_ranks))
    factors = imbalance(placement, t)
    return sum(factors) / len(factors)
