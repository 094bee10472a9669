"""Per-rank runtime: join the process group, load this rank's share of the weights, run the loop.

Used the same way by spawned local ranks (LLM from a plain process) and by torchrun ranks.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from attention_nodes.block_pool import BlockPool
from attention_nodes.host_tier import HostTier
from attention_nodes.kv_cache import KVCache, num_blocks_for
from attention_nodes.leader import Leader
from attention_nodes.model import AttentionModel, MoEContext
from attention_nodes.scheduler import Scheduler
from attention_nodes.worker import AttentionWorker
from balancer.placement import Placement, eplb, expert_load, load_balance, slot_capacities
from balancer.policy import make_policy
from balancer.replan import CHECKPOINT, Replan, plan_membership, plan_moves, plan_rebalance
from comm.calibration import shared_model
from comm.control import ControlPlane
from comm.dispatcher import ShmDispatcher, make_dispatcher
from comm.shm import host_identity, shm_supported
from comm.topology import ProcessGroups, Topology
from expert_nodes.slots import ExpertSlots
from expert_nodes.worker import ExpertWorker
from kernels.ops import resolve_backend
from models.checkpoint import Checkpoint

from . import step_protocol
from ..config import EngineConfig
from ..procs import tune_allocator
from .step_protocol import COLLECT_EVENTS, COLLECT_STATS, PREFIX, REBALANCE, Membership, MembershipError

logger = logging.getLogger("afserve")

CPU_KV_DEFAULT_BYTES = 256 << 20


@dataclass(slots=True)
class RankInfo:
    """What rank 0 tells the front once every rank is ready."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int


class Runtime:
    """One rank of the job. `worker` is an AttentionWorker or an ExpertWorker; rank 0 also has `leader`."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.store: dist.Store | None = None
        self.membership: Membership | None = None
        self.leader: Leader | None = None
        self.placement: Placement | None = None
        self.left = False
        self._stats = None      # the data plane's stats, carried from one generation to the next
        self.load_ema: torch.Tensor | None = None
        self.num_replacements = 0
        self.num_slots_moved = 0
        self.staged: dict[tuple[int, int], list[torch.Tensor]] = {}   # (layer, new slot) -> an expert's tensors
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
        config, par = self.config, self.config.parallel
        self.topo = Topology.from_env(par.attention_ranks, par.ranks_per_node, par.world_size)
        self._set_device(self.topo.world_size)
        # Generation 0 of the job's membership (launch/runtime/step_protocol.py): members are named by their first rank.
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
            self._open_store(host, port, serve)
            self._form_groups()
            self.membership = Membership(self, self.store, host, port, self.member, config.rank_failure_s)
        spec = self.ckpt.spec
        self.capacity = slot_capacities(spec.num_experts, par.redundant_experts, par.expert_ranks)
        self.rank_node = self._expert_nodes()
        self.placement = initial_placement(spec.num_moe_layers, spec.num_experts, par.redundant_experts,
                                           self.capacity, self.rank_node)
        self.dispatcher = self._make_dispatcher(spec)
        desc = f"rank {self.topo.rank} ({self.topo.role})"
        # The first rank of each role draws a progress bar: real checkpoints take minutes to read.
        first_of_role = self.topo.rank == 0 or (not self.topo.is_attention and self.topo.expert_index == 0)
        progress = sys.stderr if first_of_role and config.load_progress else None
        if self.topo.is_attention:
            self._build_attention(self._moe_context(), desc, progress)
        else:
            row = self.placement.slot2expert[:, self.topo.expert_index]
            self._check_expert_memory(int(row.shape[1]))
            slots = ExpertSlots.load(self.ckpt, row, self.dtype, self.device, desc, self.kernel_backend, progress)
            self.worker = ExpertWorker(self.topo.rank, slots, self.dispatcher, spec.num_moe_layers, par.micro_batches)
        # The smallest KV pool bounds what any request may need; rank 0 reports it to the front.
        blocks = torch.tensor([self.worker.block_pool.num_blocks if self.topo.is_attention else 2**62])
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.groups.control)
        self.info = RankInfo(int(blocks), config.cache.block_size, self.max_model_len)
        logger.info("%s ready: %d tensors read", desc, len(self.ckpt.names_read))

    def _start_pool_leader(self) -> None:
        """The attention pool's first rank: serve the job's store at pool_addr, publish the settings every rank
        takes, then form generation 0 from the ranks that register (attention_ranks - 1 more attention ranks and
        expert_ranks expert ranks, within startup_timeout_s). Expert weights come from the checkpoint."""
        config, par = self.config, self.config.parallel
        host, port = config.pool_host_port()
        self._open_store(host, port, serve=True)
        self.generation, self.member, self.members = -1, 0, [0]
        self.topo = Topology(0, 1, 1, par.ranks_per_node or par.world_size, forming=True)
        self._set_device(par.world_size)
        self.membership = Membership(self, self.store, host, port, self.member, config.rank_failure_s)
        self._build_attention(None, "rank 0 (attention)", sys.stderr if config.load_progress else None)
        self.membership.form_pool(par.attention_ranks, par.expert_ranks)
        self.info = RankInfo(self.worker.block_pool.num_blocks, config.cache.block_size, self.max_model_len)

    def _start_joiner(self) -> None:
        """A rank that joins through the leader's store: at start-up (separate pool launches), or a running job
        (a pool that grows). It takes the leader's settings, loads what its role holds before it knows its
        place (an attention rank: its model and KV cache; an expert rank: nothing), registers, and forms the
        generation that admits it (expert weights then come from peers or the checkpoint)."""
        host, port = self.config.pool_host_port()
        self._open_store(host, port, serve=False)
        self.store.wait([f"{PREFIX}/config"])
        settings = msgpack.unpackb(self.store.get(f"{PREFIX}/config"), strict_map_key=False)
        self.config = config = self.config.with_leader_settings(settings)
        par, spec = config.parallel, self.ckpt.spec
        member = os.environ.get("AFSERVE_MEMBER")
        self.member = int(member) if member is not None else int(self.store.add(f"{PREFIX}/member_ids", 1))
        self.generation, self.members, self.topo = -1, [], None
        self._set_device(par.world_size)
        self.membership = Membership(self, self.store, host, port, self.member, config.rank_failure_s)
        desc = f"member {self.member} ({config.role})"
        if config.role == "attention":
            self._build_attention(None, desc, None)
            blocks = self.worker.block_pool.num_blocks
        else:
            empty = torch.full((spec.num_moe_layers, 0), -1, dtype=torch.int64)
            slots = ExpertSlots.empty(self.ckpt, empty, self.dtype, self.device, self.kernel_backend)
            self.worker = ExpertWorker(-1, slots, None, spec.num_moe_layers, par.micro_batches)
            blocks = 0
        self.membership.join(config.role, {**self.member_info(config.role), "kv_blocks": blocks})
        self.info = RankInfo(blocks, config.cache.block_size, self.max_model_len)
        logger.info("%s joined generation %d as rank %d", desc, self.generation, self.topo.rank)

    @property
    def max_model_len(self) -> int:
        """The longest sequence served: the configured limit within the model's positions."""
        spec = self.ckpt.spec
        return min(self.config.scheduler.max_model_len or spec.max_position_embeddings,
                   spec.max_position_embeddings)

    def _open_store(self, host: str, port: int, serve: bool) -> None:
        self.store = dist.TCPStore(host, port, is_master=serve, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.config.startup_timeout_s))

    def _set_device(self, world_size: int) -> None:
        config = self.config
        if config.device_type() == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            tune_allocator()
            cores = os.cpu_count() or 1
            torch.set_num_threads(config.threads_per_rank or max(1, cores // world_size))
        self.dtype = config.torch_dtype(self.device)
        self.kernel_backend = resolve_backend(config.kernel_backend, self.device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"

    def _build_attention(self, moe: MoEContext | None, desc: str, progress) -> None:
        """This rank's attention model, KV cache and scheduler (moe None: no generation yet); rank 0 leads."""
        config, par, spec = self.config, self.config.parallel, self.ckpt.spec
        weights = self.ckpt.read(self.ckpt.attention_tensor_names(), self.dtype, self.device, desc, progress)
        model = AttentionModel(spec, weights, self.device, self.kernel_backend)
        num_blocks = self._num_kv_blocks(spec)
        cache = config.cache
        host_blocks = self._num_host_blocks(spec)
        kv = KVCache(spec.num_layers, num_blocks, cache.block_size, spec.kv_entry, self.dtype, self.device,
                     host_blocks)
        pool = BlockPool(num_blocks, cache.block_size, HostTier(host_blocks) if host_blocks else None,
                         track_events=cache.enable_prefix_caching and par.attention_ranks > 1)
        sched = Scheduler(pool, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                          cache.enable_prefix_caching)
        rank = self.topo.rank if self.topo is not None else -1
        self.worker = AttentionWorker(rank, model, kv, sched, moe, self.max_model_len, self.device, par.micro_batches)
        if rank == 0:
            self.leader = Leader(self.worker, self.topo.num_attention_ranks, cache.block_size,
                                 par.rebalance_interval, pool.track_events)
            self.leader.membership = self.membership
            self.leader.num_expert_ranks = self.topo.num_expert_ranks
            if self.store is not None:   # what ranks joining later take (launch/runtime/step_protocol.py, "Joining")
                self.store.set(f"{PREFIX}/config", msgpack.packb(config.leader_settings()))

    # ----- groups and generations ---------------------------------------------------------------------------
    def _form_groups(self) -> None:
        """This generation's process groups, from the store keys under its prefix."""
        store = dist.PrefixStore(f"{PREFIX}/g{self.generation}/pg", self.store)
        dist.init_process_group(self.backend, store=store, rank=self.topo.rank, world_size=self.topo.world_size,
                                timeout=timedelta(seconds=self.config.collective_timeout_s))
        self.groups = ProcessGroups.create(self.topo)
        self.control = ControlPlane(self.groups.control, self.groups.attention, self.topo.rank,
                                    self.topo.num_attention_ranks)

    def _expert_nodes(self) -> list[int]:
        A = self.topo.num_attention_ranks
        return [self.topo.node_of(A + r) for r in range(self.topo.num_expert_ranks)]

    def _moe_context(self) -> MoEContext:
        spec, par = self.ckpt.spec, self.config.parallel
        return MoEContext(self.dispatcher, make_policy(par.balancer, self.placement), self.topo.num_attention_ranks,
                          self.placement.num_slots, spec.num_experts, self.groups.attention, self.topo.rank)

    def leave_generation(self) -> None:
        """A peer was lost: wake this rank's shm peers and abort every process group of the generation, then
        drop every reference to them; the caller's gc.collect() then lets gloo close their connections, which
        breaks the exchanges of ranks still waiting on this one (a gloo recv ends only when its peer's
        connection does), so they leave too. Called outside any `except` block: a live traceback would keep the
        failed call's groups alive."""
        self.dispatcher.abort()
        dist.distributed_c10d._abort_process_group()
        stats = self.dispatcher.stats
        self.dispatcher = self.groups = self.control = None
        if self.topo.is_attention:
            self.worker.moe = None
        else:
            self.worker.dispatcher = None
        self._stats = stats
        self.left = True

    def member_info(self, role: str | None = None) -> dict:
        """What this rank tells the leader when it checks in after a failure or joins: its role, and for an
        expert rank the bytes it may hold in expert weights (expert_memory, else what it holds plus what is
        free)."""
        info = {"role": role or self.topo.role}
        if info["role"] == "expert":
            info["expert_budget"] = self._expert_budget()
        return info

    def _expert_budget(self) -> int:
        par = self.config.parallel
        if par.expert_memory is not None:
            return par.expert_memory
        held = sum(t.numel() * t.element_size() for t in self.worker.slots._per_slot())
        if self.device.type == "cuda":
            return held + torch.cuda.mem_get_info(self.device)[0]
        return held + _host_available_bytes()

    def _check_expert_memory(self, num_slots: int) -> None:
        limit = self.config.parallel.expert_memory
        need = num_slots * ExpertSlots.bytes_per_slot(self.ckpt, self.dtype)
        if limit is not None and need > limit:
            raise ValueError(f"expert rank {self.topo.rank}: {num_slots} expert slots need {need / 2**20:.1f} MiB but "
                             f"expert_memory={limit} ({limit / 2**20:.1f} MiB); raise expert_memory or add expert "
                             f"ranks")

    def plan_generation(self, generation: int, infos: dict[int, dict], lost: list[int],
                        joined: list[tuple[int, dict]] = (), retiring: bool = False) -> dict:
        """Leader: the plan of the next generation (msgpack-able; step_protocol publishes it): the members of
        this one except `lost` (dead, or retiring when `retiring`), then the `joined` (member, info) in order,
        each after the kept ranks of its role. infos: member -> info (member_info) of every expert member that
        stays. Retiring expert ranks are alive: the experts that only they hold go from them to the staying
        ranks that take them ("staged", sent in this generation before it ends) instead of from the checkpoint.
        Raises MembershipError when the new pools cannot serve."""
        A = self.topo.num_attention_ranks
        gone = [self.members.index(m) for m in lost]
        new_attention = [m for m, info in joined if info["role"] == "attention"]
        new_experts = [(m, info) for m, info in joined if info["role"] == "expert"]
        attention_keep = [r for r in range(A) if self.members[r] not in lost] + [-1] * len(new_attention)
        assert attention_keep[0] == 0, "the leader plans only while it lives"
        experts = self.members[A:]
        keep = [i for i, m in enumerate(experts) if m not in lost] + [-1] * len(new_experts)
        if not keep:
            raise MembershipError(f"every expert rank died (ranks {gone}); the job ends")
        spec, par = self.ckpt.spec, self.config.parallel
        if len(keep) > spec.num_experts:
            raise MembershipError(f"{len(keep)} expert ranks exceed the model's {spec.num_experts} experts; "
                                  f"use at most {spec.num_experts}")
        A2 = len(attention_keep)
        new_topo = Topology(0, A2 + len(keep), A2, self.topo.ranks_per_node)
        rank_node = [new_topo.node_of(A2 + i) for i in range(len(keep))]
        try:
            if self.placement is None:        # the first generation of separate pool launches
                capacity = slot_capacities(spec.num_experts, par.redundant_experts, len(keep))
                fresh = initial_placement(spec.num_moe_layers, spec.num_experts, par.redundant_experts, capacity,
                                          rank_node)
                empty = torch.empty(spec.num_moe_layers, 0, 0, dtype=torch.int64)
                replan = Replan(fresh, plan_moves(empty, fresh.slot2expert, keep))
            elif keep == list(range(len(experts))):   # the expert pool is unchanged: experts stay where they are
                replan = Replan(self.placement, [])
            else:
                replan = plan_membership(self.placement, keep, par.redundant_experts, rank_node, self.load_ema)
        except ValueError as e:
            raise MembershipError(f"the {len(keep)} expert rank(s) cannot hold the model's {spec.num_experts} "
                                  f"experts: {e}") from e
        per_slot = ExpertSlots.bytes_per_slot(self.ckpt, self.dtype)
        S = replan.placement.num_slots
        expert_members = [experts[k] for k in keep if k >= 0] + [m for m, _ in new_experts]
        infos = {**infos, **dict(new_experts)}
        for i, (k, m) in enumerate(zip(keep, expert_members)):
            budget = infos[m]["expert_budget"]
            if S * per_slot > budget:
                was = f"expert rank {A + k} (now {A2 + i})" if k >= 0 else f"joining member {m} (rank {A2 + i})"
                raise MembershipError(
                    f"the expert ranks cannot hold every expert: {was} would need {S * per_slot / 2**20:.1f} MiB "
                    f"for {S} slots of {spec.num_experts} experts but may hold {budget / 2**20:.1f} MiB; add an "
                    f"expert rank or give each more memory (expert_memory)")
        members = [self.members[r] for r in attention_keep if r >= 0] + new_attention + expert_members
        staged = self._staged_moves(replan, keep, [i for i, m in enumerate(experts) if m in lost]) \
            if retiring and self.placement is not None else []
        return {"gen": generation, "members": members, "attention_ranks": A2, "attention_keep": attention_keep,
                "keep": keep, "staged": staged, "joined": [m for m, _ in joined],
                "kv_blocks": [info.get("kv_blocks", 0) for m, info in joined if info["role"] == "attention"],
                "ranks_per_node": self.topo.ranks_per_node,
                "slot2expert": replan.placement.slot2expert.tolist(),
                "moves": [list(m) for m in replan.moves], "from_peers": replan.num_from_peers + len(staged),
                "from_checkpoint": replan.num_from_checkpoint - len(staged)}

    def _staged_moves(self, replan: Replan, keep: list[int], donors: list[int]) -> list[list[int]]:
        """Of replan's moves from the checkpoint, those whose expert a retiring expert rank (donors: old expert
        indices) holds: [layer, old index of the staying destination, its new slot, donor, donor's slot]."""
        old, new = self.placement.slot2expert, replan.placement.slot2expert
        staged = []
        for layer, dst, dslot, src, _ in replan.moves:
            if src != CHECKPOINT or keep[dst] < 0:   # a joining rank is not in this generation to receive
                continue
            e = int(new[layer, dst, dslot])
            for d in donors:
                row = old[layer, d].tolist()
                if e in row:
                    staged.append([layer, keep[dst], dslot, d, row.index(e)])
                    break
        return staged

    def regroup(self, plan: dict) -> dict:
        """Join the plan's generation: form its groups, its data plane, and adopt its expert placement (expert
        ranks copy or read the weights of the slots they gain; a rank that joins starts with none). Returns
        timings in seconds."""
        t0 = time.perf_counter()
        spec, par = self.ckpt.spec, self.config.parallel
        old = self.topo
        was_expert_index = old.expert_index if old is not None and not old.forming and not old.is_attention else -1
        self.generation, self.members = plan["gen"], list(plan["members"])
        A = plan["attention_ranks"]
        self.topo = Topology(self.members.index(self.member), len(self.members), A, plan["ranks_per_node"])
        self._form_groups()
        self.left = False
        new = torch.tensor(plan["slot2expert"], dtype=torch.int64)
        self.placement = Placement(new, spec.num_experts, None if self.placement is None else self.placement.load)
        self.capacity = slot_capacities(spec.num_experts, par.redundant_experts, self.topo.num_expert_ranks)
        self.rank_node = self._expert_nodes()
        self.dispatcher = self._make_dispatcher(spec)
        t1 = time.perf_counter()
        if self.topo.is_attention:
            self.worker.rank = self.topo.rank
            self.worker.adopt(self._moe_context())
            if self.leader is not None:
                handover = {int(src): dst for src, dst in plan.get("handover", {}).items()}
                self.leader.regroup(plan["attention_keep"], plan["kv_blocks"], handover)
                self.leader.num_expert_ranks = self.topo.num_expert_ranks
        else:
            assert plan["keep"][self.topo.expert_index] == was_expert_index
            moves = [tuple(m) for m in plan["moves"]]
            slots, received, read = self.worker.slots.adopt(self.ckpt, moves, new[:, self.topo.expert_index],
                                                            self.topo.expert_index, lambda r: A + r,
                                                            self.groups.world, self.staged)
            self.staged = {}
            self.worker.rank = self.topo.rank
            self.worker.adopt(slots, self.dispatcher)
            self.num_slots_moved += received
        # every rank has its weights before any serves a step
        dist.barrier(group=self.groups.control)
        t2 = time.perf_counter()
        logger.info("rank %d (member %d): generation %d formed", self.topo.rank, self.member, self.generation)
        return {"groups_s": t1 - t0, "weights_s": t2 - t1}

    def stage_experts(self, staged: list[list[int]]) -> None:
        """An expert rank, in the generation that is ending: send or receive the plan's staged experts
        ([layer, staying rank, its new slot, retiring rank, its slot], expert indices of this generation); what
        arrives is kept for regroup."""
        A = self.topo.num_attention_ranks
        self.staged, _, _ = self.worker.slots.exchange(staged, self.topo.expert_index, lambda r: A + r,
                                                       self.groups.world)

    def lead(self, inbox, outbox, heartbeat_s: float, stop_when_idle: bool = False) -> str:
        """The leader's loop (launch/runtime/step_protocol.py)."""
        return step_protocol.lead(self, inbox, outbox, heartbeat_s, stop_when_idle)

    def follow(self) -> str:
        """Every other rank's loop (launch/runtime/step_protocol.py): obey headers until pause or shutdown."""
        return step_protocol.follow(self)

    def _make_dispatcher(self, spec):
        par = self.config.parallel
        kw = dict(group=self.groups.world, hidden_size=spec.hidden_size, top_k=spec.top_k, dtype=self.dtype,
                  device=self.device, num_sources=self.topo.num_attention_ranks,
                  ranks_per_node=self.topo.ranks_per_node)
        if self._stats is not None:   # a new generation keeps the stats so far
            kw["stats"] = self._stats
        if self._use_shm():
            return ShmDispatcher(**kw, control=self.groups.control,
                                 max_tokens=self.config.scheduler.max_num_batched_tokens,
                                 depth=par.micro_batches + 1, timeout_s=self.config.collective_timeout_s)
        if par.comm == "auto":   # a collective: every rank measures (or rank 0 loads) the same model
            kw["model"] = shared_model(par.comm_calibration, self.config.scheduler.max_num_batched_tokens, **kw)
        return make_dispatcher(par.comm, **kw)

    def _use_shm(self) -> bool:
        """shm: CPU ranks on one host and one (emulated) node. Every rank must reach the same answer."""
        choice, comm = self.config.parallel.transport, self.config.parallel.comm
        if choice == "shm" and comm != "direct":
            raise ValueError(f"transport='shm' carries comm='direct' only, not comm={comm!r}; "
                             f"use transport='collective' or 'auto'")
        if choice == "collective" or self.device.type != "cpu" or comm != "direct":
            return False
        host = int.from_bytes(hashlib.sha256(host_identity().encode()).digest()[:7], "little")
        here = torch.tensor([host, int(shm_supported())])
        every = [torch.zeros_like(here) for _ in range(self.topo.world_size)]
        dist.all_gather(every, here, group=self.groups.control)
        possible = all(int(e[0]) == int(here[0]) and int(e[1]) for e in every) and self.topo.num_nodes == 1
        if choice == "shm" and not possible:
            raise ValueError("transport='shm' needs every rank on one Linux x86-64 host and one node "
                             "(ranks_per_node >= world size); use transport='collective'")
        return possible

    def _num_host_blocks(self, spec) -> int:
        """Blocks of the host KV tier: kv_offload_memory bytes in the device pool's block layout."""
        memory = self.config.cache.kv_offload_memory
        if not memory:
            return 0
        return num_blocks_for(memory, spec.num_layers, self.config.cache.block_size, spec.kv_entry, self.dtype,
                              "kv_offload_memory")

    def _num_kv_blocks(self, spec) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        memory = cache.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                memory = int(free * 0.8)
            else:
                memory = CPU_KV_DEFAULT_BYTES
        return num_blocks_for(memory, spec.num_layers, cache.block_size, spec.kv_entry, self.dtype)

    def collective_hooks(self) -> dict:
        """Header kinds that every rank (the leader too) answers with a collective between steps."""
        return {REBALANCE: self.rebalance, COLLECT_STATS: self.gather_stats,
                COLLECT_EVENTS: lambda: self.gather_stats(events=True)}

    def rebalance(self) -> None:
        """Live re-placement, on every rank at once between steps: gather what each expert slot served since
        the last one, fold it into the load EMA, recompute the placement (every rank gets the same answer),
        move the expert weights that change rank with send/recv, and adopt the new placement."""
        spec = self.ckpt.spec
        A = self.topo.num_attention_ranks
        L, S = self.placement.num_layers, self.placement.num_slots
        if self.topo.is_attention:
            mine = torch.zeros(L, S, dtype=torch.int64)
        else:
            mine = self.worker.load.take_slot_counts()
        every = [torch.empty_like(mine) for _ in range(self.topo.world_size)]
        dist.all_gather(every, mine, group=self.groups.control)
        counts = torch.stack(every[A:], dim=1)                                       # [L, n, S]
        observed = expert_load(self.placement.slot2expert, counts, spec.num_experts)
        if float(observed.sum()) == 0:
            return
        self.load_ema = observed if self.load_ema is None else 0.5 * self.load_ema + 0.5 * observed
        replan = plan_rebalance(self.placement, self.load_ema, self.capacity, self.rank_node)
        if torch.equal(replan.placement.slot2expert, self.placement.slot2expert):
            return
        self.placement = replan.placement
        if self.topo.is_attention:
            self.worker.moe.policy.set_placement(self.placement)
        else:
            new = self.placement.slot2expert
            self.num_slots_moved += self.worker.slots.move(replan.moves, new[:, self.topo.expert_index],
                                                           self.topo.expert_index, lambda r: A + r, self.groups.world)
        self.num_replacements += 1
        logger.info("rank %d: re-placement %d, %d slot copies", self.topo.rank, self.num_replacements,
                    len(replan.moves))

    def gather_stats(self, events: bool = False) -> dict | None:
        """Every rank's comm stats and load history (and with `events` its recent calls) to the leader -> the
        merged dict there, None elsewhere."""
        stats = self.dispatcher.stats
        mine = {"rank": self.topo.rank, "role": self.topo.role, "kernel_backend": self.kernel_backend,
                "layers": stats.to_dict(), "compute": stats.compute_dict()}
        if events:
            mine["events"] = stats.events_list()
        if not self.topo.is_attention:
            mine["step_loads"] = self.worker.load.step_loads().tolist()
            mine["slots_moved"] = self.num_slots_moved
        every = self.control.gather_objects(mine)
        if every is None:
            return None
        par = self.config.parallel
        loads = [torch.tensor(r["step_loads"], dtype=torch.int64) for r in every if "step_loads" in r]
        steps = min(t.shape[0] for t in loads)
        L = self.placement.num_layers
        stacked = torch.stack([t[t.shape[0] - steps:].reshape(steps, L) for t in loads])     # [n, steps, L]
        balance = load_balance(stacked)
        totals = stacked.sum(dim=1)                                                          # [n, L]
        return {"comm": par.comm, "comm_mode": self.dispatcher.describe(),
                "balancer": par.balancer, "redundant_experts": par.redundant_experts,
                "replacements": self.num_replacements,
                "slots_moved": sum(r.get("slots_moved", 0) for r in every),
                "ranks": {str(r["rank"]): {k: r[k] for k in ("role", "kernel_backend", "layers", "compute", "events")
                                           if k in r}
                          for r in every},
                "expert_load": {"steps": steps, "layers": {str(layer): {
                    "max_mean": balance[layer], "pairs_per_rank": totals[:, layer].tolist()} for layer in range(L)}}}

    def close(self) -> None:
        """Leave the job, on every rank after the shutdown header: first wait until all ranks are here, so that
        none tears its connections down while a peer still reads from them (gloo then aborts the process with
        'terminate called without an active exception'; seen on rank 0 right after it sent the header)."""
        if self.membership is not None:
            self.membership.close()
        if dist.is_initialized() and not self.left:
            dist.barrier(group=self.groups.control)
            dist.destroy_process_group()


def leads_pool(role: str | None, leader_host: str | None) -> bool:
    """Separate pool launches: rank 0 of the attention pool's launch on the leader's host (on any host without
    leader_host) leads the job; a rank that LLM.scale spawned (AFSERVE_MEMBER set) never does."""
    return (role == "attention" and int(os.environ.get("RANK", "0")) == 0 and "AFSERVE_MEMBER" not in os.environ
            and leader_host in (None, socket.gethostname()))


def initial_placement(num_layers: int, num_experts: int, redundant_experts: int, capacity: list[int],
                      rank_node: list[int]) -> Placement:
    """A job's first placement, before any load is seen: contiguous blocks without redundant slots, else EPLB
    on uniform load."""
    if redundant_experts == 0:
        return Placement.identity(num_layers, num_experts, len(capacity))
    return eplb(torch.ones(num_layers, num_experts), capacity, rank_node)


def _host_available_bytes() -> int:
    """Linux: MemAvailable from /proc/meminfo; elsewhere a large number (no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62
