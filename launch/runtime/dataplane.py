"""A generation's data plane: which dispatcher carries its dispatch/combine (comm/), chosen the same way on
every rank."""
from __future__ import annotations

import hashlib
from functools import partial

import torch
import torch.distributed as dist

from balancer.policy import POLICIES
from comm.calibration import shared_model
from comm.dispatcher import Dispatcher
from comm.modes import make_dispatcher
from comm.shm import host_identity, shm_supported
from comm.shm_dispatcher import ShmDispatcher
from comm.stats import CommStats
from comm.topology import ProcessGroups, Topology
from models.spec import ModelSpec

from ..config import EngineConfig
from .sizing import DeviceSettings, micro_batch_capacity


def make_data_plane(config: EngineConfig, topo: Topology, groups: ProcessGroups, dev: DeviceSettings,
                    spec: ModelSpec, stats: CommStats | None) -> Dispatcher:
    """The dispatcher of this generation: the same-host inboxes (shm on CPU, cuda_ipc on GPUs) on one host,
    else the comm mode over the world group.
    stats: the previous generation's, carried on (None: fresh)."""
    kw = dict(group=groups.world, hidden_size=spec.hidden_size, top_k=spec.top_k, dtype=dev.dtype,
              device=dev.device, num_sources=topo.num_attention_ranks, ranks_per_node=topo.ranks_per_node,
              nodes=topo.nodes)
    if stats is not None:
        kw["stats"] = stats
    # a balancer planning from every attention rank's counts has them carried by the same-host inboxes too
    count_words = spec.num_experts if POLICIES[config.parallel.balancer].needs_counts else 0
    dispatcher = _dispatcher(config, topo, groups, dev, kw, count_words)
    if config.timing_sync and dev.device.type == "cuda":
        dispatcher.stats.sync = partial(torch.cuda.synchronize, dev.device)
    return dispatcher


def _dispatcher(config: EngineConfig, topo: Topology, groups: ProcessGroups, dev: DeviceSettings,
                kw: dict, count_words: int) -> Dispatcher:
    par = config.parallel
    if use_shm(config, topo, groups, dev.device):
        return ShmDispatcher(**kw, control=groups.control, max_tokens=config.scheduler.max_num_batched_tokens,
                             depth=micro_batch_capacity(par.micro_batches, dev) + 1,
                             timeout_s=config.collective_timeout_s,
                             in_band={"auto": None, "on": True, "off": False}[par.in_band_counts],
                             ipc_events=par.cuda_ipc_events, count_words=count_words)
    if dev.node_shares_gpus:
        raise RuntimeError(f"this node's ranks share its {dev.gpus} GPU(s) ({dev.gpu_sharers} on {dev.device}) but "
                           f"the cuda_ipc transport cannot carry this job; launch at most one rank per GPU")
    if par.comm == "auto":   # a collective: every rank measures (or rank 0 loads) the same model
        kw["model"] = shared_model(par.comm_calibration, config.scheduler.max_num_batched_tokens, **kw)
    return make_dispatcher(par.comm, **kw)


def use_shm(config: EngineConfig, topo: Topology, groups: ProcessGroups, device: torch.device) -> bool:
    """The same-host inboxes (comm/shm.py): transport shm between CPU ranks, cuda_ipc between GPU ranks, on one
    host and one (emulated) node with comm='direct'. Every rank must reach the same answer (one all_gather on
    the control group)."""
    choice, comm = config.parallel.transport, config.parallel.comm
    mine = "cuda_ipc" if device.type == "cuda" else "shm"
    if choice in ("shm", "cuda_ipc") and choice != mine:
        raise ValueError(f"transport={choice!r} cannot carry {device.type.upper()} ranks: use transport={mine!r} "
                         f"(shm between CPU ranks, cuda_ipc between GPU ranks) or 'auto'")
    if choice == mine and comm != "direct":
        raise ValueError(f"transport={choice!r} carries comm='direct' only, not comm={comm!r}; "
                         f"use transport='collective' or 'auto'")
    if choice == "collective" or comm != "direct":
        return False
    host = int.from_bytes(hashlib.sha256(host_identity().encode()).digest()[:7], "little")
    here = torch.tensor([host, int(shm_supported())])
    every = [torch.zeros_like(here) for _ in range(topo.world_size)]
    dist.all_gather(every, here, group=groups.control)
    possible = all(int(e[0]) == int(here[0]) and int(e[1]) for e in every) and topo.num_nodes == 1
    if choice == mine and not possible:
        raise ValueError(f"transport={choice!r} needs every rank on one Linux x86-64 host and one node "
                         f"(ranks_per_node >= world size); use transport='collective'")
    return possible
