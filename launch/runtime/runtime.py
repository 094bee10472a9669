"""Per-rank runtime: join the process group, load this rank's share of the weights, hold what the step loops
(step_protocol.py) and membership (membership.py) work on.

Used the same way by spawned local ranks (LLM from a plain process) and by torchrun ranks.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import msgpack
import torch
import torch.distributed as dist

from attention_nodes.leader import Leader
from attention_nodes.model import MoEContext
from balancer.placement import slot_capacities
from balancer.policy import make_policy
from comm.control import ControlPlane
from comm.kv_transfer import GroupTransfer
from comm.sync_audit import SyncTally
from comm.topology import ProcessGroups, Topology
from expert_nodes.slots import ExpertSlots
from expert_nodes.worker import ExpertWorker
from models.checkpoint import Checkpoint

from ..config import ATTENTION_ROLES, EngineConfig
from ..plan.model import Plan, StepCosts
from . import collectives, handoff, memory, planning, step_protocol
from .autoscale import Autoscaler
from .changes import Launcher, MembershipSettings
from .dataplane import make_data_plane
from .forming import GenerationForming
from .liveness import DRAIN_S, MEMBER_IDS, PREFIX, break_connections, drain_or_exit, draw_member_id, stream_done
from .membership import Membership
from .sizing import (auto_micro_batches, check_expert_memory, expert_budget, host_cores, max_model_len,
                     micro_batch_capacity, plans_gpu_memory, set_device)
from .startup import (build_attention_worker, decode_graph_drafts, decode_graph_rows, draft_passes, leads_pool,
                      load_attention_model, open_store, uses_decode_graphs)

logger = logging.getLogger("afserve")


@dataclass(slots=True)
class RankInfo:
    """What rank 0 tells the front once every rank is ready."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int


class Runtime(GenerationForming):
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
        self.launcher: Launcher | None = None    # the leader's own starter of joiners (launch/joiners.py)
        self.groups: ProcessGroups | None = None     # this generation's (None out of one)
        self.control: ControlPlane | None = None
        self.dispatcher = None
        self.data_sockets: set[str] = set()   # the socket inodes this generation's groups opened
        self._stats = None      # the data plane's stats, carried from one generation to the next
        self.sync_tally = SyncTally() if config.sync_audit else None   # this rank's host syncs per decode step
        self.ckpt = Checkpoint(config.model, mtp=config.scheduler.uses_mtp, generation_config=config.generation_config)
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
            self.groups.join_first_collectives(self.dev.device)
            self.control = ControlPlane(self.groups.control, self.groups.attention, self.topo.rank,
                                        par.attention_ranks)
        else:
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
            # Under torchrun its agent serves the store at MASTER_PORT; spawned ranks: rank 0 serves it.
            serve = self.topo.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            self.store = open_store(host, port, serve, config.startup_timeout_s)
            self._form_groups(0, self.topo, config.collective_timeout_s)
            self.membership = self._membership(host, port)
            if self.topo.rank == 0:     # ranks that join later draw ids past the launch's own
                self.store.add(MEMBER_IDS, self.topo.world_size - 1)
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
                memory.plan(self.dev.device, False, peak, self.groups.control,
                            config.cache.gpu_memory_utilization)
            self.worker = ExpertWorker(self.topo.rank, slots, self.dispatcher, spec.num_moe_layers,
                                       micro_batch_capacity(par.micro_batches, self.dev), spec.num_mtp_layers)
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
        self.member = int(member) if member is not None else draw_member_id(self.store)
        self.generation, self.members, self.topo = -1, [], None
        self.dev = set_device(config, par.world_size)
        self.membership = self._membership(host, port)
        desc = f"member {self.member} ({config.role})"
        if config.role in ATTENTION_ROLES:
            self._build_attention(None, desc, None)
            blocks = self.worker.block_pool.num_blocks
        else:
            empty = torch.full((spec.num_moe_layers, 0), -1, dtype=torch.int64)
            slots = ExpertSlots.empty(self.ckpt, empty, self.dev.dtype, self.dev.device, self.dev.kernel_backend)
            self.worker = ExpertWorker(-1, slots, None, spec.num_moe_layers,
                                       micro_batch_capacity(par.micro_batches, self.dev), spec.num_mtp_layers)
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
                                         self.dev.kv_dtype)
            if uses_decode_graphs(config, self.dev):
                peak += memory.graph_reserve(model, self.ckpt.spec, decode_graph_rows(config),
                                             micro_batch_capacity(config.parallel.micro_batches, self.dev),
                                             config.cache.block_size,
                                             max_model_len(config, self.ckpt.spec), self.dev.dtype,
                                             decode_graph_drafts(config), self.dev.kv_dtype)
            kv_bytes = memory.plan(self.dev.device, True, peak, group, config.cache.gpu_memory_utilization)
        self.worker = build_attention_worker(config, self.ckpt.spec, self.dev, model, rank, moe, kv_bytes)
        self.worker.report_work = config.parallel.autoscale is not None   # what the leader's autoscaler reads
        if rank == 0:
            par = self.config.parallel
            self.leader = Leader(self.worker, self.topo.num_attention_ranks, self.config.cache.block_size,
                                 par.rebalance_interval, self.worker.block_pool.track_events,
                                 self.micro_batches(), par.micro_batch_min_tokens, *draft_passes(config),
                                 par.prefill_ranks, par.max_decode_passes, par.stream_kv)
            self.leader.num_expert_ranks = self.topo.num_expert_ranks
            if par.autoscale:
                sched = config.scheduler
                plan = Plan(1, 1, self.leader.micro_batches, max_num_seqs=min(sched.max_num_seqs,
                                                                       sched.max_num_batched_tokens),
                            max_num_batched_tokens=sched.max_num_batched_tokens,
                            micro_batch_min_tokens=par.micro_batch_min_tokens)
                self.leader.autoscaler = Autoscaler(StepCosts.load(par.autoscale), plan, self.ckpt.spec.num_experts,
                                                    par.autoscale_window, par.autoscale_margin)
            if self.membership is not None:
                self.leader.membership_changes = self.membership.changes
            if self.store is not None:   # what ranks joining later take (launch/runtime/membership.py, "Joining")
                self.store.set(f"{PREFIX}/config", msgpack.packb(self.config.leader_settings()))

    def micro_batches(self) -> int:
        """The leader's micro-batches per step: micro_batches, or auto's pick (sizing.auto_micro_batches) for the
        generation's ranks on this machine, as each member recorded its host in the store (whichever launch
        started it: torchrun, LLM's spawned ranks, a separate pool, a joiner). Without a store of ours (the
        caller formed the groups): all ranks when the launch put every rank here, else LOCAL_WORLD_SIZE."""
        par = self.config.parallel
        if par.micro_batches:
            return par.micro_batches
        if self.membership is not None:
            here = self.membership.ranks_here()
        else:
            world = self.topo.world_size
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            here = world if local >= par.world_size else local
        return auto_micro_batches(self.dev, here, host_cores())

    def _bytes_per_slot(self) -> int:
        return ExpertSlots.bytes_per_slot(self.ckpt, self.dev.dtype)

    # ----- groups and generations ---------------------------------------------------------------------------
    def _expert_nodes(self) -> list[int]:
        A = self.topo.num_attention_ranks
        return [self.topo.node_of(A + r) for r in range(self.topo.num_expert_ranks)]

    def _moe_context(self) -> MoEContext:
        spec, placement = self.ckpt.spec, self.experts.placement
        # the sync audit counts what a GPU run would read, so least_loaded plans as on a GPU (no CPU branch)
        policy = make_policy(self.config.parallel.balancer, placement, self.dev.device,
                             fixed_shape=True if self.sync_tally is not None else None)
        return MoEContext(self.dispatcher, policy, self.topo.num_attention_ranks, placement.num_slots, spec.num_experts,
                          self.groups.attention_data, self.topo.rank)

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
        failed call's groups alive. The rank stays in the generation until its device has finished what was
        queued on it (liveness.drain_or_exit: a stream left waiting on a lost peer's CUDA IPC event keeps it there
        until the heartbeat's wedge check exits it)."""
        self.dispatcher.abort()
        dist.distributed_c10d._abort_process_group()
        drain_or_exit(stream_done(self.dev.device), DRAIN_S, self.member)
        self._stats = self.dispatcher.stats
        self.dispatcher = self.groups = self.control = None
        self.worker.detach()
        self.left = True

    # ----- what membership asks of this rank (changes.MemberRuntime) -------------------------------------
    def new_member_ids(self, n: int) -> list[int]:
        """n member ids for ranks that will join, from the store's counter that every joiner draws from (a
        --pool-addr joiner takes its own), so no two members share one."""
        return [draw_member_id(self.store) for _ in range(n)]

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
                           self._bytes_per_slot(), self.topo.rank_nodes(), self.leader.prefill_ranks,
                           par.prefill_ranks > 0)
        return planning.plan_generation(job, generation, infos, lost, joined, retiring)

    def barrier(self) -> None:
        """Every rank of the current generation (the control group)."""
        dist.barrier(group=self.groups.control)

    def start_reshape(self) -> None:
        step_protocol.announce(self, step_protocol.RESHAPE)

    def attention_blocks(self) -> list[tuple[int, int]]:
        return [(r.num_free_blocks, r.num_blocks) for r in self.leader.reports]

    def moves_in_flight(self) -> bool:
        header = self.leader.inflight if self.leader is not None else None
        return header is not None and bool(header.moves)

    def kv_transfer(self) -> GroupTransfer:
        """How this generation moves requests and their KV between attention ranks (handover, PD)."""
        return GroupTransfer(self.control, self.groups.world, self.dev.kv_dtype, self.dev.device)

    def send_requests(self, dst: int) -> None:
        meta, kv = self.worker.hand_over()
        self.kv_transfer().send(meta, kv, dst,
                                lambda: step_protocol.fault_point("mid_handover", self.member, self.generation + 1))

    def receive_requests(self, src: int) -> None:
        self.worker.take_over(self.kv_transfer(), src)

    def hand_off_experts(self, plan: dict) -> None:
        """A retiring expert rank, out of the old generation: send the joiners the experts only it held
        (launch/runtime/handoff.py)."""
        if self.topo is not None and not self.topo.is_attention:
            self._handoff(plan, self.topo.expert_index, joiner=False)

    def take_handoff(self, plan: dict) -> None:
        """A joining expert rank, before it forms the plan's generation: receive them, kept like staged experts."""
        self.experts.staged = self._handoff(plan, plan["members"].index(self.member) - plan["attention_ranks"], True)

    def _handoff(self, plan: dict, index: int, joiner: bool) -> dict:
        donors, joiners = handoff.side_ranks(plan.get("handoff", []))
        ours = joiners if joiner else donors
        if index not in ours:
            return {}
        side = ours.index(index) + (len(donors) if joiner else 0)
        return handoff.exchange(self.store, self.worker.slots, plan, side, self.member, self.rendezvous_s)

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
        collectives.rebalance(self.topo, self.groups, self.worker, self.experts, self.ckpt.spec.num_experts,
                              self.config.parallel.rebalance_max_slots)

    def gather_stats(self, events: bool = False) -> dict | None:
        return collectives.gather_stats(self.topo, self.control, self.dispatcher, self.worker, self.experts,
                                        self.config.parallel, self.dev.kernel_backend, events, self.sync_tally)

    def reset_prefix_cache(self) -> bool:
        """Between steps, on every rank: an attention rank forgets its prefix cache (BlockPool.reset_cache), the
        leader its view of every rank's and what its PD stream has pushed (the decode ranks forgot it too: the
        stream sends those blocks again)."""
        if self.topo.is_attention:
            self.worker.block_pool.reset_cache()
        if self.leader is not None:
            self.leader.cached = [set() for _ in self.leader.cached]
            if self.leader.kv_stream is not None:
                self.leader.kv_stream.sent.clear()
        return True

    def close(self) -> None:
        """Leave the job, on every rank after the shutdown header: stop the heartbeat thread (Heartbeat.close
        says why it must be joined), then wait until all ranks are here, so that none tears its connections down
        while a peer still reads from them."""
        if self.membership is not None:
            self.membership.close()
        if dist.is_initialized() and not self.left:
            if self.dispatcher is not None:
                self.dispatcher.flush()
            self.barrier()
            dist.destroy_process_group()
