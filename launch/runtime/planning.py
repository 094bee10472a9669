"""The expert placement and the plan of a generation: pure functions over the job's state, which the leader
calls and the membership module publishes (launch/runtime/membership.py). No torch.distributed here."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from balancer.placement import Placement, eplb, slot_capacities
from balancer.replan import CHECKPOINT, Replan, plan_membership, plan_moves
from comm.topology import Topology


class MembershipError(RuntimeError):
    """The job cannot re-form without the ranks it lost (the message says what is missing)."""


@dataclass(slots=True)
class Job:
    """The generation the leader plans from. members: member ids by rank (attention ranks first); placement:
    None before the first generation of separate pool launches; load_ema: `[L, E]` expert load (or None)."""

    members: list[int]
    num_attention_ranks: int
    ranks_per_node: int
    placement: Placement | None
    load_ema: torch.Tensor | None
    num_experts: int
    num_moe_layers: int
    redundant_experts: int
    bytes_per_slot: int      # one expert's weights in this job's dtype
    nodes: list[int] | None = None   # the node of each rank (None: consecutive blocks of ranks_per_node)
    prefill_ranks: int = 0   # PD: the attention ranks below this number only prefill
    pd: bool = False         # the job was started with PD (prefill_ranks may have dropped to 0 with its decode ranks)


def grown_ranks_per_node(ranks_per_node: int, configured: bool, num_nodes: int, new_world: int) -> int:
    """Ranks per node of the next generation. A job on one node whose node size nobody configured (ranks that
    LLM spawned on one host, or one torchrun node) stays one node as it grows: otherwise a job grown past its
    first world size would count a second node and lose its one-node transports (shm, cuda_ipc; seen on an
    H100). Configured node sizes (emulated nodes) and jobs of several nodes keep theirs."""
    if configured or num_nodes > 1:
        return ranks_per_node
    return max(ranks_per_node, new_world)


@dataclass(slots=True)
class PlacementState:
    """What every rank keeps of the expert placement between generations. placement: None until the first
    generation (separate pool launches); capacity: slots per expert rank; rank_node: the node of each expert
    rank; load_ema: `[L, E]` float, the observed expert load (None until the first re-placement); staged: the
    experts a retiring rank sent this one ((layer, new slot) -> its tensors), kept for the next generation."""

    placement: Placement | None = None
    capacity: list[int] = field(default_factory=list)
    rank_node: list[int] = field(default_factory=list)
    load_ema: torch.Tensor | None = None
    num_replacements: int = 0
    num_slots_moved: int = 0
    staged: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)


def initial_placement(num_layers: int, num_experts: int, redundant_experts: int, capacity: list[int],
                      rank_node: list[int]) -> Placement:
    """A job's first placement, before any load is seen: contiguous blocks without redundant slots, else EPLB
    on uniform load."""
    if redundant_experts == 0:
        return Placement.identity(num_layers, num_experts, len(capacity))
    return eplb(torch.ones(num_layers, num_experts), capacity, rank_node)


def plan_generation(job: Job, generation: int, infos: dict[int, dict], lost: list[int],
                    joined: list[tuple[int, dict]] = (), retiring: bool = False) -> dict:
    """The plan of the next generation (msgpack-able): the members of this one except `lost` (dead, or retiring
    when `retiring`), then the `joined` (member, info) in order, each after the kept ranks of its role.
    infos: member -> info (Runtime.member_info) of every expert member that stays. Retiring expert ranks are
    alive: the experts that only they hold go from them to the staying ranks that take them ("staged", sent in
    this generation before it ends) instead of from the checkpoint. Raises MembershipError when the new pools
    cannot serve.

    Keys: gen, members (member ids by new rank), attention_ranks, attention_keep (old attention rank of each
    new one, -1: joined), prefill_ranks (plan_attention), keep (old expert index of each new expert rank, -1:
    joined), staged, joined, kv_blocks (of joining attention ranks, in their new order), ranks_per_node,
    slot2expert `[L, n, S]`, load (`[L, E]` the load it was placed for, or None), moves (balancer/replan.py),
    from_peers, from_checkpoint."""
    A, members = job.num_attention_ranks, job.members
    gone = [members.index(m) for m in lost]
    attention_keep, new_attention, prefill_ranks = plan_attention(job, set(gone), joined)
    new_experts = [(m, info) for m, info in joined if info["role"] == "expert"]
    assert attention_keep[0] == 0, "the leader plans only while it lives"
    experts = members[A:]
    keep = [i for i, m in enumerate(experts) if m not in lost] + [-1] * len(new_experts)
    if not keep:
        raise MembershipError(f"every expert rank died (ranks {gone}); the job ends")
    if len(keep) > job.num_experts:
        raise MembershipError(f"{len(keep)} expert ranks exceed the model's {job.num_experts} experts; "
                              f"use at most {job.num_experts}")
    A2 = len(attention_keep)
    old_nodes = job.nodes or [r // job.ranks_per_node for r in range(len(members))]
    nodes = keep_nodes([old_nodes[r] if r >= 0 else -1 for r in attention_keep] +
                       [old_nodes[A + k] if k >= 0 else -1 for k in keep], job.ranks_per_node)
    new_topo = Topology(0, A2 + len(keep), A2, job.ranks_per_node, nodes=nodes)
    rank_node = [new_topo.node_of(A2 + i) for i in range(len(keep))]
    replan = _replan(job, keep, len(experts), rank_node)
    S = replan.placement.num_slots
    expert_members = [experts[k] for k in keep if k >= 0] + [m for m, _ in new_experts]
    infos = {**infos, **dict(new_experts)}
    for i, (k, m) in enumerate(zip(keep, expert_members)):
        budget = infos[m]["expert_budget"]
        if S * job.bytes_per_slot > budget:
            was = f"expert rank {A + k} (now {A2 + i})" if k >= 0 else f"joining member {m} (rank {A2 + i})"
            raise MembershipError(
                f"the expert ranks cannot hold every expert: {was} would need {S * job.bytes_per_slot / 2**20:.1f} "
                f"MiB for {S} slots of {job.num_experts} experts but may hold {budget / 2**20:.1f} MiB; add an "
                f"expert rank or give each more memory (expert_memory)")
    joiners = iter(new_attention)
    new_members = [members[r] if r >= 0 else next(joiners) for r in attention_keep] + expert_members
    donors = [i for i, m in enumerate(experts) if m in lost]
    staged, handoff = staged_moves(job.placement, replan, keep, donors) if retiring and job.placement is not None \
        else ([], [])
    joined_info = dict(joined)
    return {"gen": generation, "members": new_members, "attention_ranks": A2, "attention_keep": attention_keep,
            "prefill_ranks": prefill_ranks, "keep": keep, "staged": staged, "joined": [m for m, _ in joined],
            "kv_blocks": [joined_info[m].get("kv_blocks", 0) for m in new_attention],
            "ranks_per_node": job.ranks_per_node, "nodes": nodes,
            "slot2expert": replan.placement.slot2expert.tolist(),
            "load": None if replan.placement.load is None else replan.placement.load.tolist(),
            "moves": [list(m) for m in replan.moves], "handoff": handoff,
            "from_peers": replan.num_from_peers + len(staged) + len(handoff),
            "from_checkpoint": replan.num_from_checkpoint - len(staged) - len(handoff)}


def placement_of(plan: dict, num_experts: int) -> Placement:
    """The placement every member of the planned generation adopts: the plan's slots and the load they were placed
    for, so that a joiner's least_loaded tables are the kept ranks' (each rank's own old load would differ)."""
    load = None if plan["load"] is None else torch.tensor(plan["load"], dtype=torch.float64)
    return Placement(torch.tensor(plan["slot2expert"], dtype=torch.int64), num_experts, load)


def keep_nodes(nodes: list[int], ranks_per_node: int) -> list[int] | None:
    """The node of each rank of the next generation. nodes: each new rank's node where it is a member that stays
    (it stays on its node: ranks are renumbered when others leave, nodes are not), -1 for one that joins, which
    takes the lowest node with fewer than ranks_per_node ranks, else a node of its own. None when that is the
    consecutive blocks of ranks_per_node ranks that a job starts with."""
    out = list(nodes)
    for i, n in enumerate(out):
        if n < 0:
            count = {m: out.count(m) for m in out if m >= 0}
            room = [m for m in sorted(count) if count[m] < ranks_per_node]
            out[i] = room[0] if room else max(count, default=-1) + 1
    return None if out == [r // ranks_per_node for r in range(len(out))] else out


def plan_attention(job: Job, gone: set[int], joined: list[tuple[int, dict]]) -> tuple[list[int], list[int], int]:
    """The next generation's attention ranks -> (attention_keep: the old rank of each, -1 for a joiner; the
    joining members in their new order; its prefill_ranks). gone: old ranks that leave; joined: (member, info)
    with info["role"] attention, prefill, decode or expert.

    Roles are positional (PD's prefill ranks are the first prefill_ranks), so with PD the kept prefill ranks come
    first, then the prefill joiners (role prefill, or attention: the leader's launch and the pool it leads),
    then the kept decode ranks, then the decode joiners. A PD job left without a decode rank runs colocated
    (prefill_ranks 0) until one joins; then all its kept ranks prefill again. A job started without PD takes
    attention and decode joiners as attention ranks, and refuses prefill joiners."""
    A = job.num_attention_ranks
    kept = [r for r in range(A) if r not in gone]
    if not job.pd:
        for m, info in joined:
            if why := joiner_refusal(m, info, False):
                raise MembershipError(why)
        others = [m for m, info in joined if info["role"] in ("attention", "decode")]
        return kept + [-1] * len(others), others, 0
    prefill = [m for m, info in joined if info["role"] in ("attention", "prefill")]
    decode = [m for m, info in joined if info["role"] == "decode"]
    cut = job.prefill_ranks or A
    keep = [r for r in kept if r < cut] + [-1] * len(prefill) + [r for r in kept if r >= cut] + [-1] * len(decode)
    num_prefill = sum(r < cut for r in kept) + len(prefill)
    return keep, prefill + decode, num_prefill if num_prefill < len(keep) else 0


def joiner_refusal(member: int, info: dict, pd: bool) -> str | None:
    """Why a registered rank cannot join the job (None: it can): a prefill rank for a job without PD."""
    if info["role"] == "prefill" and not pd:
        return (f"member {member} joins as a prefill rank, but the job runs without PD (prefill_ranks=0): launch it "
                f"with --role attention, or start the job with --prefill-ranks")
    return None


def plan_handover(blocks: list[tuple[int, int]], retiring: list[int], prefill_ranks: int = 0) -> dict[str, int]:
    """For each retiring attention rank, the staying one that takes over its requests and KV blocks ->
    {str(leaving rank): taking rank}. blocks: (free, total) KV blocks of each attention rank, as last reported.
    The taker's pool must be at least as large as the leaving rank's, so every sequence that fitted there fits
    (one needing more blocks than a pool holds would wait there for good); among those the most free blocks,
    charged for what it takes, and with PD (prefill_ranks > 0) one of the same role first (a prefill rank's
    unfinished prompts stay off the decode ranks). With no pool that large, the largest.
    retiring: the ranks that leave; expert ranks among them (ranks past the attention ranks) hold no requests."""
    retiring = [r for r in retiring if r < len(blocks)]
    staying = [r for r in range(len(blocks)) if r not in retiring]
    free = {r: blocks[r][0] for r in staying}
    out = {}
    for r in retiring:
        num_free, num_blocks = blocks[r]
        large = [k for k in staying if blocks[k][1] >= num_blocks]
        same = [k for k in large if (k < prefill_ranks) == (r < prefill_ranks)]
        dst = max(same or large, key=lambda k: (free[k], -k)) if large else \
            max(staying, key=lambda k: (blocks[k][1], -k))
        free[dst] -= num_blocks - num_free
        out[str(r)] = dst
    return out


def _replan(job: Job, keep: list[int], num_old_experts: int, rank_node: list[int]) -> Replan:
    """The new placement for the kept (and joining, -1) expert ranks, and the weight moves that realise it."""
    try:
        if job.placement is None:        # the first generation of separate pool launches
            capacity = slot_capacities(job.num_experts, job.redundant_experts, len(keep))
            fresh = initial_placement(job.num_moe_layers, job.num_experts, job.redundant_experts, capacity,
                                      rank_node)
            empty = torch.empty(job.num_moe_layers, 0, 0, dtype=torch.int64)
            return Replan(fresh, plan_moves(empty, fresh.slot2expert, keep))
        if keep == list(range(num_old_experts)):   # the expert pool is unchanged: experts stay where they are
            return Replan(job.placement, [])
        return plan_membership(job.placement, keep, job.redundant_experts, rank_node, job.load_ema)
    except ValueError as e:
        raise MembershipError(f"the {len(keep)} expert rank(s) cannot hold the model's {job.num_experts} "
                              f"experts: {e}") from e


def staged_moves(placement: Placement, replan: Replan, keep: list[int], donors: list[int]
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """Of replan's moves from the checkpoint, those whose expert a retiring expert rank (donors: old expert
    indices) holds -> (staged: to a staying rank, in the old generation: [layer, old index of the destination,
    its new slot, donor, donor's slot]; handoff: to a joining rank, which is not in the old generation: [layer,
    new index of the joiner, its new slot, donor, donor's slot])."""
    old, new = placement.slot2expert, replan.placement.slot2expert
    staged, handoff = [], []
    for layer, dst, dslot, src, _ in replan.moves:
        if src != CHECKPOINT:
            continue
        e = int(new[layer, dst, dslot])
        for d in donors:
            row = old[layer, d].tolist()
            if e in row:
                if keep[dst] >= 0:
                    staged.append([layer, keep[dst], dslot, d, row.index(e)])
                else:
                    handoff.append([layer, dst, dslot, d, row.index(e)])
                break
    return staged, handoff


def check_autoscale(parallel, lockstep: bool) -> None:
    """The autoscale option checked before any rank starts: it needs ranks that follow the leader until shutdown
    (spawned by LLM, or serve.py's under torchrun), not ranks under torchrun that call generate() together (the
    ranks a move adds could not), and its step-cost profile must load (ValueError naming the file otherwise)."""
    if parallel.autoscale is None:
        return
    if lockstep:
        raise ValueError("autoscale needs ranks that follow the leader until shutdown: under torchrun serve with "
                         "launch/serve.py --autoscale PROFILE, or run LLM(...) from a plain process")
    from ..plan.model import StepCosts
    StepCosts.load(parallel.autoscale)


def check_scale(request: dict, num_experts: int, pd: bool) -> None:
    """LLM.scale's request (attention_ranks, expert_ranks, prefill_ranks, decode_ranks: a target or None;
    retire: ranks) checked before it goes to the leader (pd: the job was started with PD, whose attention pool is
    then sized as two, prefill_ranks and decode_ranks). Raises ValueError naming a bad value; the leader, which
    knows the pools as they are now, checks the rest and names the ranks to spawn."""
    targets = {k: request.get(k) for k in ("attention_ranks", "expert_ranks", "prefill_ranks", "decode_ranks")}
    for name, v in targets.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r} is invalid: pass an integer >= 1 (or None to keep the pool)")
    if targets["expert_ranks"] is not None and targets["expert_ranks"] > num_experts:
        raise ValueError(f"expert_ranks={targets['expert_ranks']} exceeds the model's {num_experts} experts; use at "
                         f"most {num_experts}")
    if why := pools_refusal(targets, pd):
        raise ValueError(why)
    retire = request.get("retire") or []
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in retire):
        raise ValueError(f"retire={retire!r} is invalid: name ranks 1 and up (rank 0 leads the job)")


def pools_refusal(targets: dict, pd: bool) -> str | None:
    """Why a scale request's pool targets do not fit the job (None: they do): a PD job sizes prefill_ranks and
    decode_ranks, any other job attention_ranks."""
    if pd and targets.get("attention_ranks") is not None:
        return (f"attention_ranks={targets['attention_ranks']} for a PD job: size its pools with prefill_ranks and "
                f"decode_ranks")
    given = [f"{k}={targets[k]!r}" for k in ("prefill_ranks", "decode_ranks") if targets.get(k) is not None]
    if not pd and given:
        return (f"{' and '.join(given)} for a job without PD (prefill_ranks=0): scale its attention pool with "
                f"attention_ranks, or start the job with prefill_ranks")
    return None


def gpu_room_refusal(backend: str, gpus: int, ranks: int, joiners: int) -> str | None:
    """Why this machine cannot hold `joiners` more ranks spawned beside the job's `ranks` (None: it can). Ranks
    with a GPU each (backend nccl) need a free GPU per joiner, and ranks that retire keep theirs until the new
    generation has formed; ranks that share GPUs (gloo) share them with joiners too."""
    if backend != "nccl" or ranks + joiners <= gpus:
        return None
    return (f"{joiners} more rank(s) beside the job's {ranks} need {ranks + joiners} GPUs while the job changes "
            f"(each rank has a GPU of its own: NCCL), but this machine shows {gpus}; retire ranks in a scale of "
            f"their own first (scale(retire=[...])), or launch more ranks than GPUs with transport='cuda_ipc' so "
            f"that ranks share them")
