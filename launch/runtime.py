"""Per-rank runtime: join the process group, load this rank's share of the weights, run the loop.

Used the same way by spawned local ranks (LLM from a plain process) and by torchrun ranks.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from attention_nodes.block_pool import BlockPool
from attention_nodes.host_tier import HostTier
from attention_nodes.kv_cache import KVCache, num_blocks_for
from attention_nodes.leader import Leader, run_attention_step
from attention_nodes.model import AttentionModel, MoEContext
from attention_nodes.scheduler import Scheduler
from attention_nodes.worker import AttentionWorker
from balancer.placement import Placement, eplb, expert_load, load_balance, plan_moves, slot_capacities, stabilize
from balancer.policy import make_policy
from comm.calibration import shared_model
from comm.control import COLLECT_EVENTS, COLLECT_STATS, IDLE, PAUSE, REBALANCE, SHUTDOWN, ControlPlane
from comm.dispatcher import ShmDispatcher, make_dispatcher
from comm.shm import host_identity, shm_supported
from comm.topology import ProcessGroups, Topology
from expert_nodes.slots import ExpertSlots
from expert_nodes.worker import ExpertWorker
from kernels.ops import resolve_backend
from models.checkpoint import Checkpoint

from .config import EngineConfig
from .procs import tune_allocator

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
        par = config.parallel
        self.topo = Topology.from_env(par.attention_ranks, par.ranks_per_node, par.world_size)
        if config.device_type() == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            tune_allocator()
            cores = os.cpu_count() or 1
            torch.set_num_threads(config.threads_per_rank or max(1, cores // self.topo.world_size))
        self.dtype = config.torch_dtype(self.device)
        self.kernel_backend = resolve_backend(config.kernel_backend, self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=self.topo.rank, world_size=self.topo.world_size,
                                    timeout=timedelta(seconds=config.collective_timeout_s))
        self.groups = ProcessGroups.create(self.topo)
        self.control = ControlPlane(self.groups.control, self.groups.attention, self.topo.rank,
                                    par.attention_ranks)
        self.ckpt = Checkpoint(config.model)
        spec = self.ckpt.spec
        self.max_model_len = min(config.scheduler.max_model_len or spec.max_position_embeddings,
                                 spec.max_position_embeddings)
        self.capacity = slot_capacities(spec.num_experts, par.redundant_experts, par.expert_ranks)
        self.rank_node = [self.topo.node_of(par.attention_ranks + r) for r in range(par.expert_ranks)]
        if par.redundant_experts == 0:
            placement = Placement.identity(spec.num_moe_layers, spec.num_experts, par.expert_ranks)
        else:   # no load observed yet: uniform
            placement = eplb(torch.ones(spec.num_moe_layers, spec.num_experts), self.capacity, self.rank_node)
        self.placement = placement
        self.load_ema: torch.Tensor | None = None
        self.num_replacements = 0
        self.num_slots_moved = 0
        self.dispatcher = self._make_dispatcher(spec)
        desc = f"rank {self.topo.rank} ({self.topo.role})"
        # The first rank of each role draws a progress bar: real checkpoints take minutes to read.
        first_of_role = self.topo.rank == 0 or (not self.topo.is_attention and self.topo.expert_index == 0)
        progress = sys.stderr if first_of_role and config.load_progress else None
        self.leader: Leader | None = None
        if self.topo.is_attention:
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
            moe = MoEContext(self.dispatcher, make_policy(par.balancer, placement), par.attention_ranks,
                             placement.num_slots, spec.num_experts, self.groups.attention, self.topo.rank)
            self.worker = AttentionWorker(self.topo.rank, model, kv, sched, moe, self.max_model_len, self.device,
                                          par.micro_batches)
            if self.topo.is_leader:
                self.leader = Leader(self.control, self.worker, par.attention_ranks, config.cache.block_size,
                                     self.collective_hooks(), par.rebalance_interval, pool.track_events)
        else:
            slots = ExpertSlots.load(self.ckpt, placement.slot2expert[:, self.topo.expert_index], self.dtype,
                                     self.device, desc, self.kernel_backend, progress)
            self.worker = ExpertWorker(self.topo.rank, slots, self.dispatcher, spec.num_moe_layers, par.micro_batches)
        # The smallest KV pool bounds what any request may need; rank 0 reports it to the front.
        blocks = torch.tensor([self.worker.block_pool.num_blocks if self.topo.is_attention else 2**62])
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.groups.control)
        self.info = RankInfo(int(blocks), config.cache.block_size, self.max_model_len)
        logger.info("%s ready: %d tensors read", desc, len(self.ckpt.names_read))

    def _make_dispatcher(self, spec):
        par = self.config.parallel
        kw = dict(group=self.groups.world, hidden_size=spec.hidden_size, top_k=spec.top_k, dtype=self.dtype,
                  device=self.device, num_sources=par.attention_ranks, ranks_per_node=self.topo.ranks_per_node)
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

    def follow(self) -> str:
        """Every rank but the leader: obey step headers until pause or shutdown (returns which)."""
        while True:
            header = self.control.broadcast_header(None)
            if header.kind in (SHUTDOWN, PAUSE):
                return header.kind
            if header.kind == IDLE:
                continue
            hooks = self.collective_hooks()
            if header.kind in hooks:
                hooks[header.kind]()
                continue
            if self.topo.is_attention:
                self.control.gather_reports(run_attention_step(self.worker, header))
            else:
                self.worker.step(header.capacity)

    def collective_hooks(self) -> dict:
        """Header kinds that every rank (the leader too) answers with a collective between steps."""
        return {REBALANCE: self.rebalance, COLLECT_STATS: self.gather_stats,
                COLLECT_EVENTS: lambda: self.gather_stats(events=True)}

    def rebalance(self) -> None:
        """Live re-placement, on every rank at once between steps: gather what each expert slot served since
        the last one, fold it into the load EMA, recompute the placement (every rank gets the same answer),
        move the expert weights that change rank with send/recv, and adopt the new placement."""
        par, spec = self.config.parallel, self.ckpt.spec
        L, S = self.placement.num_layers, self.placement.num_slots
        if self.topo.is_attention:
            mine = torch.zeros(L, S, dtype=torch.int64)
        else:
            mine = self.worker.load.take_slot_counts()
        every = [torch.empty_like(mine) for _ in range(self.topo.world_size)]
        dist.all_gather(every, mine, group=self.groups.control)
        counts = torch.stack(every[par.attention_ranks:], dim=1)                     # [L, n, S]
        observed = expert_load(self.placement.slot2expert, counts, spec.num_experts)
        if float(observed.sum()) == 0:
            return
        self.load_ema = observed if self.load_ema is None else 0.5 * self.load_ema + 0.5 * observed
        old = self.placement.slot2expert
        new = stabilize(old, eplb(self.load_ema, self.capacity, self.rank_node).slot2expert)
        if torch.equal(new, old):
            return
        moves = plan_moves(old, new)
        self.placement = Placement(new, spec.num_experts, self.load_ema)
        if self.topo.is_attention:
            self.worker.moe.policy.set_placement(self.placement)
        else:
            self.num_slots_moved += self.worker.slots.move(moves, new[:, self.topo.expert_index],
                                                           self.topo.expert_index,
                                                           lambda r: par.attention_ranks + r, self.groups.world)
        self.num_replacements += 1
        logger.info("rank %d: re-placement %d, %d slot copies", self.topo.rank, self.num_replacements, len(moves))

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
        if dist.is_initialized():
            dist.barrier(group=self.groups.control)
            dist.destroy_process_group()
