"""Per-rank runtime: join the process group, load this rank's share of the weights, hold what the step loops
(step_protocol.py) and membership (membership.py) work on.

Used the same way by spawned local ranks (LLM from a plain process) and by torchrun ranks.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from collections.abc import Callable
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from attention_nodes.leader import Leader
from attention_nodes.model import MoEContext
from balancer.placement import Placement, slot_capacities
from balancer.policy import make_policy
from comm import p2p
from comm.control import ControlPlane
from comm.failures import is_peer_failure
from comm.sync_audit import SyncTally
from comm.topology import ProcessGroups, Topology
from expert_nodes.slots import ExpertSlots
from expert_nodes.worker import ExpertWorker
from models.checkpoint import Checkpoint

from ..config import EngineConfig
from . import collectives, memory, planning, step_protocol
from .changes import FormingFailed, MembershipSettings
from .dataplane import make_data_plane
from .liveness import PREFIX, break_connections, socket_inodes
from .membership import Membership
from .sizing import check_expert_memory, expert_budget, max_model_len, plans_gpu_memory, set_device
from .startup import build_attention_worker, leads_pool, load_attention_model, open_store

logger = logging.getLogger("afserve")
RENDEZVOUS_S = 10.0   # the longest a generation's groups wait in their rendezvous (at least 3 x rank_failure_s)


@dataclass(slots=True)
class RankInfo:
    """What rank 0 tells the front once every rank is ready."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int


class Runtime:
    """One rank of the job. `worker` is an AttentionWorker or an ExpertWorker; rank 0 also has `leader`.
    The job's generation: `generation` (-1 before the first), `members` (member ids by rank), `member` (this
    rank's), `topo`, `groups`, `control` and `dispatcher` (None after leaving it, until the next one)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.store: dist.Store | None = None
        self.membership: Membership | None = None
        self.leader: Leader | None = None
        self.experts = planning.PlacementState()
        self.left = False
        self.groups: ProcessGroups | None = None     # this generation's (None out of one)
        self.control: ControlPlane | None = None
        self.dispatcher = None
        self.data_sockets: set[str] = set()   # the socket inodes this generation's groups opened
        self._stats = None      # the data plane's stats, carried from one generation to the next
        self.sync_tally = SyncTally() if config.sync_audit else None   # this rank's host syncs per decode step
        self.ckpt = Checkpoint(config.model)
        if config.role is None:
            self._start_world()
        elif leads_pool(config.role, config.leader_host):
            self._start_pool_leader()
        else:
            self._start_joiner()

    # ----- start-up -----------------------------------------------------------------------------------------
    def _start_world(self) -> None:
        """One launch (torchrun, or ranks spawned by LLM): roles by rank, generation 0 is the whole world."""
        config, par, spec = self.config, self.config.parallel, self.ckpt.spec
        self.topo = Topology.from_env(par.attention_ranks, par.ranks_per_node, par.world_size)
        self.dev = set_device(config, self.topo.world_size)
        # Generation 0 of the job's membership (launch/runtime/membership.py): members are named by their first rank.
        self.generation, self.member = 0, self.topo.rank
        self.members = list(range(self.topo.world_size))
        if dist.is_initialized():   # the caller formed the groups: no store of ours, so no re-forming
            self.groups = ProcessGroups.create(self.topo)
            self.control = ControlPlane(self.groups.control, self.groups.attention, self.topo.rank,
                                        par.attention_ranks)
        else:
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
            # Under torchrun its agent serves the store at MASTER_PORT; spawned ranks: rank 0 serves it.
            serve = self.topo.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            self.store = open_store(host, port, serve, config.startup_timeout_s)
            self._form_groups(0, self.topo, config.collective_timeout_s)
            self.membership = self._membership(host, port)
        self.experts.capacity = slot_capacities(spec.num_experts, par.redundant_experts, par.expert_ranks)
        self.experts.rank_node = self._expert_nodes()
        self.experts.placement = planning.initial_placement(spec.num_moe_layers, spec.num_experts,
                                                            par.redundant_experts, self.experts.capacity,
                                                            self.experts.rank_node)
        self.dispatcher = make_data_plane(config, self.topo, self.groups, self.dev, spec, None)
        desc = f"rank {self.topo.rank} ({self.topo.role})"
        # The first rank of each role draws a progress bar: real checkpoints take minutes to read.
        first_of_role = self.topo.rank == 0 or (not self.topo.is_attention and self.topo.expert_index == 0)
        progress = sys.stderr if first_of_role and config.load_progress else None
        if self.topo.is_attention:
            self._build_attention(self._moe_context(), desc, progress, self.groups.control)
        else:
            row = self.experts.placement.slot2expert[:, self.topo.expert_index]
            check_expert_memory(self.topo.rank, int(row.shape[1]), self._bytes_per_slot(), par.expert_memory)
            slots = ExpertSlots.load(self.ckpt, row, self.dev.dtype, self.dev.device, desc, self.dev.kernel_backend,
                                     progress)
            if plans_gpu_memory(config.cache, self.dev):
                rows = par.attention_ranks * config.scheduler.max_num_batched_tokens
                peak = memory.expert_peak(slots, rows, spec.top_k, spec.hidden_size, self.dev.dtype, self.dev.device)
                self._plan_gpu_memory(False, peak, self.groups.control)
            self.worker = ExpertWorker(self.topo.rank, slots, self.dispatcher, spec.num_moe_layers, par.micro_batches)
        # The smallest KV pool bounds what any request may need; rank 0 reports it to the front.
        blocks = torch.tensor([self.worker.block_pool.num_blocks if self.topo.is_attention else 2**62])
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.groups.control)
        self.info = RankInfo(int(blocks), config.cache.block_size, max_model_len(config, spec))
        logger.info("%s ready: %d tensors read", desc, len(self.ckpt.names_read))

    def _start_pool_leader(self) -> None:
        """The attention pool's first rank: serve the job's store at pool_addr, publish the settings every rank
        takes, then form generation 0 from the ranks that register (attention_ranks - 1 more attention ranks and
        expert_ranks expert ranks, within startup_timeout_s). Expert weights come from the checkpoint."""
        config, par = self.config, self.config.parallel
        host, port = config.pool_host_port()
        self.store = open_store(host, port, True, config.startup_timeout_s)
        self.generation, self.member, self.members = -1, 0, [0]
        self.topo = Topology(0, 1, 1, par.ranks_per_node or par.world_size, forming=True)
        self.dev = set_device(config, par.world_size)
        self.membership = self._membership(host, port)
        self._build_attention(None, "rank 0 (attention)", sys.stderr if config.load_progress else None)
        self.membership.form_pool(par.attention_ranks, par.expert_ranks)
        self.info = RankInfo(self.worker.block_pool.num_blocks, config.cache.block_size,
                             max_model_len(config, self.ckpt.spec))

    def _start_joiner(self) -> None:
        """A rank that joins through the leader's store: at start-up (separate pool launches), or a running job
        (a pool that grows). It takes the leader's settings, loads what its role holds before it knows its
        place (an attention rank: its model and KV cache; an expert rank: nothing), registers, and forms the
        generation that admits it (expert weights then come from peers or the checkpoint)."""
        host, port = self.config.pool_host_port()
        self.store = open_store(host, port, False, self.config.startup_timeout_s)
        self.store.wait([f"{PREFIX}/config"])
        settings = msgpack.unpackb(self.store.get(f"{PREFIX}/config"), strict_map_key=False)
        self.config = config = self.config.with_leader_settings(settings)
        par, spec = config.parallel, self.ckpt.spec
        member = os.environ.get("AFSERVE_MEMBER")
        self.member = int(member) if member is not None else int(self.store.add(f"{PREFIX}/member_ids", 1))
        self.generation, self.members, self.topo = -1, [], None
        self.dev = set_device(config, par.world_size)
        self.membership = self._membership(host, port)
        desc = f"member {self.member} ({config.role})"
        if config.role == "attention":
            self._build_attention(None, desc, None)
            blocks = self.worker.block_pool.num_blocks
        else:
            empty = torch.full((spec.num_moe_layers, 0), -1, dtype=torch.int64)
            slots = ExpertSlots.empty(self.ckpt, empty, self.dev.dtype, self.dev.device, self.dev.kernel_backend)
            self.worker = ExpertWorker(-1, slots, None, spec.num_moe_layers, par.micro_batches)
            blocks = 0
        self.membership.join(config.role, {**self.member_info(config.role), "kv_blocks": blocks})
        self.info = RankInfo(blocks, config.cache.block_size, max_model_len(config, spec))
        logger.info("%s joined generation %d as rank %d", desc, self.generation, self.topo.rank)

    def _membership(self, host: str, port: int) -> Membership:
        c = self.config
        return Membership(self, self.store, host, port, MembershipSettings(
            c.rank_failure_s, c.collective_timeout_s, c.startup_timeout_s, c.parallel.expert_memory))

    def _build_attention(self, moe: MoEContext | None, desc: str, progress, group=None) -> None:
        """This rank's attention model, KV cache and scheduler (moe None: no generation yet); rank 0 leads.
        group: the launch's control group, whose ranks all take part in the GPU memory plan (None: a rank
        that starts alone, which plans with what it sees of its GPU)."""
        rank = self.topo.rank if self.topo is not None else -1
        config = self.config
        model = load_attention_model(config, self.ckpt, self.dev, desc, progress)
        kv_bytes = None
        if plans_gpu_memory(config.cache, self.dev):
            sched = config.scheduler
            peak = memory.attention_peak(model, self.ckpt.spec, sched.max_num_batched_tokens, sched.max_num_seqs,
                                         max_model_len(config, self.ckpt.spec), config.cache.block_size,
                                         self.dev.dtype)
            kv_bytes = self._plan_gpu_memory(True, peak, group)
        self.worker = build_attention_worker(config, self.ckpt.spec, self.dev, model, rank, moe, kv_bytes)
        if rank == 0:
            par = self.config.parallel
            self.leader = Leader(self.worker, self.topo.num_attention_ranks, self.config.cache.block_size,
                                 par.rebalance_interval, self.worker.block_pool.track_events,
                                 par.micro_batches, par.micro_batch_min_tokens)
            self.leader.num_expert_ranks = self.topo.num_expert_ranks
            if self.membership is not None:
                self.leader.membership_changes = self.membership.changes
            if self.store is not None:   # what ranks joining later take (launch/runtime/membership.py, "Joining")
                self.store.set(f"{PREFIX}/config", msgpack.packb(self.config.leader_settings()))

    def _plan_gpu_memory(self, attention: bool, peak: int, group) -> int | None:
        """The GPU memory plan (launch/runtime/memory.py), once this rank has loaded and warmed up: after a
        barrier of `group`'s ranks (all loaded, caches emptied) each reads its GPU's use, the ranks share what
        they read, and an attention rank gets its KV bytes (an expert rank None)."""
        torch.cuda.empty_cache()
        if group is not None:
            dist.barrier(group=group)
        share = memory.measure_share(self.dev.device, attention, peak)
        shares, me = [share], 0
        if group is not None:
            shares = [None] * dist.get_world_size(group)
            dist.all_gather_object(shares, share, group=group)
            me = dist.get_rank(group)
        if not attention:
            return None
        kv = memory.kv_cache_bytes(me, shares, self.config.cache.gpu_memory_utilization)
        logger.info("GPU memory plan: %s used %.2f GiB of %.2f, warm-up peaks %s MiB; KV cache %.2f GiB",
                    share.gpu, share.used / 2**30, share.total / 2**30,
                    [s.peak >> 20 for s in shares if s.gpu == share.gpu], kv / 2**30)
        return kv

    def _bytes_per_slot(self) -> int:
        return ExpertSlots.bytes_per_slot(self.ckpt, self.dev.dtype)

    # ----- groups and generations ---------------------------------------------------------------------------
    def _form_groups(self, generation: int, topo: Topology, rendezvous_s: float) -> None:
        """The process groups of a generation (this rank placed by topo), from the store keys under its prefix.
        Their rendezvous waits at most rendezvous_s, then raises with nothing formed (a member that died once
        it was ready never arrives); then the default group's collectives wait collective_timeout_s, the others'
        torch's default for their backend (as before the bound)."""
        store = dist.PrefixStore(f"{PREFIX}/g{generation}/pg", self.store)
        # NCCL: eager init on this rank's GPU (device_id), so the first point-to-point needs no lazy communicator
        eager = self.dev.device if self.dev.backend == "nccl" else None
        before = socket_inodes()
        bound = timedelta(seconds=rendezvous_s)
        dist.init_process_group(self.dev.backend, store=store, rank=topo.rank, world_size=topo.world_size,
                                timeout=bound, device_id=eager)
        groups = ProcessGroups.create(topo, timeout=bound)
        c10d = dist.distributed_c10d
        c10d._set_pg_timeout(timedelta(seconds=self.config.collective_timeout_s), groups.world)
        for g, backend in ((groups.control, "gloo"), (groups.attention, "gloo"), (groups.node, self.dev.backend),
                           (groups.local, self.dev.backend)):
            if g is not None:
                c10d._set_pg_timeout(c10d._get_default_timeout(backend), g)
        self.groups = groups
        self.data_sockets = socket_inodes() - before   # what the heartbeat shuts down if this rank wedges
        self.control = ControlPlane(groups.control, groups.attention, topo.rank, topo.num_attention_ranks)

    def _expert_nodes(self) -> list[int]:
        A = self.topo.num_attention_ranks
        return [self.topo.node_of(A + r) for r in range(self.topo.num_expert_ranks)]

    def _moe_context(self) -> MoEContext:
        spec, placement = self.ckpt.spec, self.experts.placement
        return MoEContext(self.dispatcher, make_policy(self.config.parallel.balancer, placement, self.dev.device),
                          self.topo.num_attention_ranks, placement.num_slots, spec.num_experts, self.groups.attention,
                          self.topo.rank)

    def interrupt_generation(self, store_port: int) -> int:
        """From the heartbeat thread, when a peer has left the generation this rank is still in: end this rank's
        waits on its data plane (shut down the generation's connections, interrupt its shm inbox) -> how many
        connections were shut down."""
        dispatcher = self.dispatcher
        if dispatcher is not None:
            dispatcher.interrupt()
        return break_connections(self.data_sockets, store_port)

    def watched_members(self) -> list[int]:
        """The members whose heartbeats this rank watches for silence: the leader's peers in its generation."""
        if self.leader is None or self.left:
            return []
        return [m for m in self.members if m != self.member]

    def leave_generation(self) -> None:
        """A peer was lost: wake this rank's shm peers and abort every process group of the generation, then
        drop every reference to them; the caller's gc.collect() then lets gloo close their connections, which
        breaks the exchanges of ranks still waiting on this one (a gloo recv ends only when its peer's
        connection does), so they leave too. Called outside any `except` block: a live traceback would keep the
        failed call's groups alive."""
        self.dispatcher.abort()
        dist.distributed_c10d._abort_process_group()
        self._stats = self.dispatcher.stats
        self.dispatcher = self.groups = self.control = None
        self.worker.detach()
        self.left = True

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
        bound = min(self.config.collective_timeout_s, max(RENDEZVOUS_S, 3 * self.config.rank_failure_s))
        failed, prepared = None, None
        try:
            self._form_groups(gen, topo, bound)
        except RuntimeError as e:    # gloo's connection errors and the store's wait timeout alike
            failed = (f"the process groups of generation {gen} did not form within {bound:.0f} s (a member died "
                      f"once it was ready?): {str(e).splitlines()[0][:200]}")
        if failed is None:
            step_protocol.fault_point("groups", self.member, gen)   # formed the groups, no weights yet
            try:
                prepared = self._prepare_generation(plan, topo)
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
        self._adopt_generation(plan, topo, prepared)
        logger.info("rank %d (member %d): generation %d formed", self.topo.rank, self.member, self.generation)
        groups_s = prepared["data_plane_at"] - t0
        return {"groups_s": groups_s, "weights_s": time.perf_counter() - t0 - groups_s}

    def _prepare_generation(self, plan: dict, topo: Topology) -> dict:
        """What forming the plan's generation exchanges with peers, none of it adopted yet: the data plane
        (self.dispatcher, so a breaker can interrupt it) and, on an expert rank, the new slots."""
        spec, A = self.ckpt.spec, topo.num_attention_ranks
        self.dispatcher = make_data_plane(self.config, topo, self.groups, self.dev, spec, self._stats)
        prepared = {"data_plane_at": time.perf_counter(), "slots": None, "received": 0}
        if not topo.is_attention:
            old = self.topo
            was = old.expert_index if old is not None and not old.forming and not old.is_attention else -1
            assert plan["keep"][topo.expert_index] == was
            new = torch.tensor(plan["slot2expert"], dtype=torch.int64)
            moves = [tuple(m) for m in plan["moves"]]
            prepared["slots"], prepared["received"], _ = self.worker.slots.adopt(
                self.ckpt, moves, new[:, topo.expert_index], topo.expert_index, lambda r: A + r, self.groups.world,
                self.experts.staged)
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

    def _adopt_generation(self, plan: dict, topo: Topology, prepared: dict) -> None:
        """Every member has its weights: take the generation on (no exchange with peers here)."""
        spec, par, state = self.ckpt.spec, self.config.parallel, self.experts
        self.generation, self.members, self.topo = plan["gen"], list(plan["members"]), topo
        self.left = False
        new = torch.tensor(plan["slot2expert"], dtype=torch.int64)
        state.placement = Placement(new, spec.num_experts, None if state.placement is None else state.placement.load)
        state.capacity = slot_capacities(spec.num_experts, par.redundant_experts, topo.num_expert_ranks)
        state.rank_node = self._expert_nodes()
        if topo.is_attention:
            self.worker.rank = topo.rank
            self.worker.adopt(self._moe_context())
            if self.leader is not None:
                handover = {int(src): dst for src, dst in plan.get("handover", {}).items()}
                held = {int(r): ids for r, ids in plan["held"].items()} if "held" in plan else None
                self.leader.regroup(plan["attention_keep"], plan["kv_blocks"], handover, held)
                self.leader.num_expert_ranks = topo.num_expert_ranks
        else:
            state.staged = {}
            self.worker.rank = topo.rank
            self.worker.adopt(prepared["slots"], self.dispatcher)
            state.num_slots_moved += prepared["received"]

    # ----- what membership asks of this rank (changes.MemberRuntime) -------------------------------------
    def member_info(self, role: str | None = None) -> dict:
        """What this rank tells the leader when it checks in after a failure or joins: its role, and for an
        expert rank the bytes it may hold in expert weights (expert_memory, else what it holds plus what is
        free)."""
        info = {"role": role or self.topo.role}
        if info["role"] == "attention" and self.topo is not None:   # where requests are, after a failed change
            info["requests"] = self.worker.held_requests()
        if info["role"] == "expert":
            info["expert_budget"] = expert_budget(self.config.parallel.expert_memory, self.worker.slots,
                                                  self.dev.device)
        return info

    def plan_generation(self, generation: int, infos: dict[int, dict], lost: list[int],
                        joined: list[tuple[int, dict]] = (), retiring: bool = False) -> dict:
        spec, par, state = self.ckpt.spec, self.config.parallel, self.experts
        new_world = len(self.members) - len(lost) + len(joined)
        rpn = planning.grown_ranks_per_node(self.topo.ranks_per_node, par.ranks_per_node is not None,
                                            self.topo.num_nodes, new_world)
        job = planning.Job(self.members, self.topo.num_attention_ranks, rpn, state.placement,
                           state.load_ema, spec.num_experts, spec.num_moe_layers, par.redundant_experts,
                           self._bytes_per_slot(), self.topo.rank_nodes())
        return planning.plan_generation(job, generation, infos, lost, joined, retiring)

    def barrier(self) -> None:
        """Every rank of the current generation (the control group)."""
        dist.barrier(group=self.groups.control)

    def start_reshape(self) -> None:
        step_protocol.announce(self, step_protocol.RESHAPE)

    def attention_blocks(self) -> list[tuple[int, int]]:
        return [(r.num_free_blocks, r.num_blocks) for r in self.leader.reports]

    def send_requests(self, dst: int) -> None:
        meta, kv = self.worker.hand_over()
        self.control.send_object(meta, dst)
        step_protocol.fault_point("mid_handover", self.member, self.generation + 1)
        if meta["num_blocks"]:
            p2p.send(kv, dst, self.groups.world)

    def receive_requests(self, src: int) -> None:
        meta = self.control.recv_object(src)
        kv = torch.empty(meta["shape"], dtype=self.dev.dtype, device=self.dev.device)
        if meta["num_blocks"]:
            p2p.recv(kv, src, self.groups.world)
        self.worker.take_over(meta, kv)

    def hand_off_experts(self, plan: dict) -> None:
        """A retiring expert rank, out of the old generation: send the joiners of the plan's generation the experts
        only it held (plan "handoff"), over a side group with them; best effort (the joiners read what does not
        arrive from the checkpoint)."""
        donors, _ = planning.handoff_ranks(plan.get("handoff", []))
        if self.topo is not None and not self.topo.is_attention and self.topo.expert_index in donors:
            self._handoff(plan, donors.index(self.topo.expert_index))

    def take_handoff(self, plan: dict) -> None:
        """A joining expert rank, before it forms the plan's generation: receive from the retiring ranks the
        experts only they held, kept for regroup like staged experts (nothing, if the handoff fails: those
        slots are read from the checkpoint)."""
        donors, joiners = planning.handoff_ranks(plan.get("handoff", []))
        index = plan["members"].index(self.member) - plan["attention_ranks"]
        if index in joiners:
            self.experts.staged = self._handoff(plan, len(donors) + joiners.index(index))

    def _handoff(self, plan: dict, side_rank: int) -> dict:
        """This rank's part of the plan's handoff as side rank side_rank -> what landed here ((layer, slot) -> the
        expert's tensors; empty when it failed)."""
        donors, joiners = planning.handoff_ranks(plan["handoff"])
        bound = max(RENDEZVOUS_S, 3 * self.config.rank_failure_s)
        failed = None
        try:
            group = p2p.SideGroup(self.store, f"{PREFIX}/g{plan['gen']}/handoff", side_rank,
                                  len(donors) + len(joiners), bound)
            landed, received, _ = self.worker.slots.exchange(planning.side_moves(plan["handoff"]), side_rank,
                                                            lambda r: r, group)
            logger.info("member %d: handoff of generation %d: %d experts received", self.member, plan["gen"],
                        received)
            return landed
        except RuntimeError as e:    # a side that died or never came: the checkpoint has every expert
            failed = str(e).splitlines()[0][:200]
        logger.warning("member %d: the expert handoff of generation %d failed (%s); the joiners read those experts "
                       "from the checkpoint", self.member, plan["gen"], failed)
        return {}

    def abandon_change(self) -> None:
        """A planned change failed before its generation formed: drop the experts staged for it (the next plan
        is another)."""
        self.experts.staged = {}

    def stage_experts(self, staged: list[list[int]]) -> None:
        """([layer, staying rank, its new slot, retiring rank, its slot], expert indices of this generation);
        what arrives is kept for regroup."""
        A = self.topo.num_attention_ranks
        self.experts.staged, _, _ = self.worker.slots.exchange(staged, self.topo.expert_index, lambda r: A + r,
                                                               self.groups.world)

    # ----- the between-step collectives (step_protocol.StepRuntime) -----------------------------------------
    def rebalance(self) -> None:
        collectives.rebalance(self.topo, self.groups, self.worker, self.experts, self.ckpt.spec.num_experts)

    def gather_stats(self, events: bool = False) -> dict | None:
        return collectives.gather_stats(self.topo, self.control, self.dispatcher, self.worker, self.experts,
                                        self.config.parallel, self.dev.kernel_backend, events, self.sync_tally)

    def close(self) -> None:
        """Leave the job, on every rank after the shutdown header: first wait until all ranks are here, so that
        none tears its connections down while a peer still reads from them (gloo then aborts the process with
        'terminate called without an active exception'; seen on rank 0 right after it sent the header)."""
        if self.membership is not None:
            self.membership.close()
        if dist.is_initialized() and not self.left:
            if self.dispatcher is not None:
                self.dispatcher.flush()
            self.barrier()
            dist.destroy_process_group()
