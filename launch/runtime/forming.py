"""Forming a generation on one rank: its process groups, its data plane and its expert weights, then, once every
member has them (agree, launch/runtime/generations.py), taking it on. Part of Runtime (runtime.py), as a mixin:
the same object, whose state (generation, members, topo, groups, control, dispatcher, worker, leader, experts)
only this and runtime.py change."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from balancer.placement import Placement, slot_capacities
from comm.control import ControlPlane
from comm.failures import is_peer_failure
from comm.topology import ProcessGroups, Topology

from . import step_protocol
from .changes import FormingFailed
from .dataplane import make_data_plane
from .liveness import PREFIX, socket_inodes
from .planning import placement_of

logger = logging.getLogger("afserve")
RENDEZVOUS_S = 10.0   # the longest a generation's groups wait in their rendezvous (at least 3 x rank_failure_s)


class GenerationForming:
    """Runtime's generation forming (see the module's docstring)."""

    @property
    def rendezvous_s(self) -> float:
        """The longest a rendezvous of this job's ranks waits for a member that never comes (a generation's groups,
        within collective_timeout_s; an expert handoff's side group)."""
        return max(RENDEZVOUS_S, 3 * self.config.rank_failure_s)

    def _form_groups(self, generation: int, topo: Topology, rendezvous_s: float) -> None:
        """The process groups of a generation (this rank placed by topo), from the store keys under its prefix
        (ProcessGroups.form: a rendezvous bounded by rendezvous_s), and the sockets they opened."""
        before = socket_inodes()
        self.groups = groups = ProcessGroups.form(dist.PrefixStore(f"{PREFIX}/g{generation}/pg", self.store), topo,
                                                  self.dev.backend, self.dev.device, rendezvous_s,
                                                  self.config.collective_timeout_s)
        self.data_sockets = socket_inodes() - before   # what the heartbeat shuts down if this rank wedges
        self.control = ControlPlane(groups.control, groups.attention, topo.rank, topo.num_attention_ranks)

    def regroup(self, plan: dict, agree: Callable[[bool], bool]) -> dict:
        """Join the plan's generation: form its groups and its data plane, and gather the weights of its expert
        placement (expert ranks copy or read the slots they gain; a rank that joins starts with none); then
        agree(True) waits until every member has done the same (or one was lost: False). Only then does this
        rank adopt the generation (placement, slots, requests), a local step that no peer can interrupt. A
        failure before that (the rendezvous did not complete, a peer was lost while the weights moved, or
        agree said no) calls agree(False), drops what was formed and raises FormingFailed with this rank as it
        was (out of any generation). Returns timings in seconds."""
        t0 = time.perf_counter()
        gen, A, members = plan["gen"], plan["attention_ranks"], list(plan["members"])
        topo = Topology(members.index(self.member), len(members), A, plan["ranks_per_node"], nodes=plan["nodes"])
        bound = min(self.config.collective_timeout_s, self.rendezvous_s)
        placement = placement_of(plan, self.ckpt.spec.num_experts)
        failed, prepared = None, None
        try:
            self._form_groups(gen, topo, bound)
        except RuntimeError as e:    # gloo's connection errors and the store's wait timeout alike
            failed = (f"the process groups of generation {gen} did not form within {bound:.0f} s (a member died "
                      f"once it was ready?): {str(e).splitlines()[0][:200]}")
        if failed is None:
            step_protocol.fault_point("groups", self.member, gen)   # formed the groups, no weights yet
            try:
                prepared = self._prepare_generation(plan, topo, placement.slot2expert)
            except Exception as e:
                if not is_peer_failure(e):
                    raise
                failed = (f"a member was lost while generation {gen} set up its data plane and weights: "
                          f"{str(e).splitlines()[0][:200]}")
        if failed is None:
            step_protocol.fault_point("weights", self.member, gen)   # has its weights, not yet agreed
            if not agree(True):
                failed = f"a member was lost before every member of generation {gen} had its weights"
        if failed is not None:       # outside the except blocks: see leave_generation
            agree(False)
            self._drop_forming()
            raise FormingFailed(failed)
        self._adopt_generation(plan, topo, placement, prepared)
        logger.info("rank %d (member %d): generation %d formed", self.topo.rank, self.member, self.generation)
        groups_s = prepared["data_plane_at"] - t0
        return {"groups_s": groups_s, "weights_s": time.perf_counter() - t0 - groups_s}

    def _prepare_generation(self, plan: dict, topo: Topology, slot2expert: torch.Tensor) -> dict:
        """What forming the plan's generation exchanges with peers, none of it adopted yet: the data plane
        (self.dispatcher, so a breaker can interrupt it) and, on an expert rank, the new slots of slot2expert
        `[L, n, S]` (the plan's placement)."""
        spec, A = self.ckpt.spec, topo.num_attention_ranks
        self.dispatcher = make_data_plane(self.config, topo, self.groups, self.dev, spec, self._stats)
        prepared = {"data_plane_at": time.perf_counter(), "slots": None, "received": 0}
        if not topo.is_attention:
            old = self.topo
            was = old.expert_index if old is not None and not old.forming and not old.is_attention else -1
            assert plan["keep"][topo.expert_index] == was
            moves = [tuple(m) for m in plan["moves"]]
            prepared["slots"], prepared["received"], _ = self.worker.slots.adopt(
                self.ckpt, moves, slot2expert[:, topo.expert_index], topo.expert_index, lambda r: A + r,
                self.groups.world, self.experts.staged)
        return prepared

    def _drop_forming(self) -> None:
        """A generation that did not form: abort what of it was formed (its groups, its data plane); nothing
        of this rank's state was changed."""
        if self.dispatcher is not None:
            self.dispatcher.abort()
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
        self.dispatcher = self.groups = self.control = None
        self.data_sockets = set()

    def _adopt_generation(self, plan: dict, topo: Topology, placement: Placement, prepared: dict) -> None:
        """Every member has its weights: take the generation on (no exchange with peers here)."""
        spec, par, state = self.ckpt.spec, self.config.parallel, self.experts
        self.generation, self.members, self.topo = plan["gen"], list(plan["members"]), topo
        self.left = False
        state.placement = placement
        state.capacity = slot_capacities(spec.num_experts, par.redundant_experts, topo.num_expert_ranks)
        state.rank_node = self._expert_nodes()
        # every rank starts its load EMA afresh (a joiner has none; the plan used the old one), so that all compute
        # the same re-placements; the expert ranks' slot counts start afresh with their new slots too
        state.load_ema = None
        if topo.is_attention:
            self.worker.rank = topo.rank
            self.worker.adopt(self._moe_context())
            if self.leader is not None:
                handover = {int(src): dst for src, dst in plan.get("handover", {}).items()}
                held = {int(r): ids for r, ids in plan["held"].items()} if "held" in plan else None
                self.leader.regroup(plan["attention_keep"], plan["kv_blocks"], handover, held,
                                    plan.get("prefill_ranks"))
                self.leader.num_expert_ranks = topo.num_expert_ranks
                self.leader.micro_batches = self.micro_batches()   # auto follows the ranks on this host
                if self.leader.autoscaler is not None:
                    self.leader.autoscaler.plan = replace(self.leader.autoscaler.plan,
                                                          micro_batches=self.leader.micro_batches)
        else:
            state.staged = {}
            self.worker.rank = topo.rank
            self.worker.adopt(prepared["slots"], self.dispatcher)
            state.num_slots_moved += prepared["received"]
