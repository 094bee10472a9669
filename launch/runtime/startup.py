"""What a rank builds at start-up, whichever way it starts (one launch, the leader of separate pool launches,
a joiner): the job's store, and its attention model, then its KV cache and scheduler (sized after the GPU memory
plan, launch/runtime/memory.py, where there is one)."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from attention_nodes.block_pool import BlockPool
from attention_nodes.draft_model import DraftModel
from attention_nodes.graphs import SINK_BLOCKS, DecodeGraphs
from attention_nodes.host_tier import HostTier
from attention_nodes.kv_cache import KVCache
from attention_nodes.model import AttentionModel, MoEContext
from attention_nodes.mtp import MTPProposer
from attention_nodes.scheduler import Scheduler
from attention_nodes.speculation import SpeculativeConfig, scratch_blocks
from attention_nodes.structured import Grammars
from attention_nodes.worker import AttentionWorker
from kernels import cpu_attention
from models.checkpoint import Checkpoint, load_tokenizer
from models.spec import ModelSpec

from ..config import EngineConfig
from .sizing import (DeviceSettings, DraftKV, decode_threads, max_model_len, micro_batch_capacity, num_host_blocks,
                     num_kv_blocks)


def leads_pool(role: str | None, leader_host: str | None) -> bool:
    """Separate pool launches: rank 0 of the attention pool's launch on the leader's host (on any host without
    leader_host) leads the job; a rank that LLM.scale spawned (AFSERVE_MEMBER set) never does."""
    return (role == "attention" and int(os.environ.get("RANK", "0")) == 0 and "AFSERVE_MEMBER" not in os.environ
            and leader_host in (None, socket.gethostname()))


def open_store(host: str, port: int, serve: bool, timeout_s: float) -> dist.TCPStore:
    """The job's TCP store: served by this process (serve) or reached at host:port."""
    return dist.TCPStore(host, port, is_master=serve, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def load_attention_model(config: EngineConfig, ckpt: Checkpoint, dev: DeviceSettings, desc: str,
                         progress) -> AttentionModel:
    """An attention rank's model: its share of the checkpoint (progress: a stream for the loading bar, or
    None), with the C decode's threads set on the CPU backend (and its float8 build made, for a float8 cache)."""
    check_kv_dtype(ckpt.spec, dev, config.cache.kv_cache_dtype)
    weights = ckpt.read(ckpt.attention_tensor_names(), dev.dtype, dev.device, desc, progress)
    model = AttentionModel(ckpt.spec, weights, dev.device, dev.kernel_backend)
    if dev.kernel_backend == "cpu":
        cpu_attention.set_threads(decode_threads(config))
        if dev.dtype == torch.float32 and dev.kv_dtype in cpu_attention.KV_FORMATS:   # the C decode's queries
            cpu_attention.library(dev.kv_dtype)
    return model


def check_kv_dtype(spec: ModelSpec, dev: DeviceSettings, option: str) -> None:
    """Refuse a float8 KV cache (the kv_cache_dtype option's value) for an MLA model, whose cache holds a compressed
    latent (no oracle has checked it rounded)."""
    if dev.kv_dtype != dev.dtype and spec.mla is not None:
        raise ValueError(f"kv_cache_dtype={option!r} is not supported for MLA models (this checkpoint's attention "
                         f"caches a compressed latent): use kv_cache_dtype='auto'")


def build_attention_worker(config: EngineConfig, spec: ModelSpec, dev: DeviceSettings, model: AttentionModel,
                           rank: int, moe: MoEContext | None, kv_bytes: int | None) -> AttentionWorker:
    """An attention rank's worker around its model: KV cache, block pool and scheduler. moe: how it reaches
    the experts (None: no generation yet); rank -1: no place in the job yet; kv_bytes: the GPU memory plan's
    KV bytes (launch/runtime/memory.py), used when the cache size is not configured."""
    par, cache = config.parallel, config.cache
    speculative = config.scheduler.speculative
    num_blocks = num_kv_blocks(cache, spec, dev, kv_bytes, draft_kv(speculative, spec, config))
    host_blocks = num_host_blocks(cache, spec, dev.kv_dtype)
    graphs = uses_decode_graphs(config, dev)
    kv = KVCache(spec.num_layers, num_blocks + (SINK_BLOCKS if graphs else 0), cache.block_size, spec.kv_entry,
                 dev.kv_dtype, dev.device, host_blocks)
    if graphs:
        model.graphs = DecodeGraphs(model, kv, decode_graph_rows(config),
                                    -(-max_model_len(config, spec) // cache.block_size), num_blocks,
                                    emulate=dev.device.type == "cpu", drafts=decode_graph_drafts(config))
        model.graphs.capture_all(micro_batch_capacity(par.micro_batches, dev))
    pool = BlockPool(num_blocks, cache.block_size, HostTier(host_blocks) if host_blocks else None,
                     track_events=cache.enable_prefix_caching and par.attention_ranks > 1)
    sched = Scheduler(pool, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                      cache.enable_prefix_caching, config.scheduler.scheduling_policy)
    exclusive = lambda block: pool.refcount(block) == 1    # noqa: E731
    draft = None if speculative is None or speculative.model is None else load_draft_model(
        speculative, spec, dev, num_blocks, cache.block_size, config.scheduler.max_num_seqs, exclusive,
        cache.kv_cache_dtype)
    mtp = None if not config.scheduler.uses_mtp else MTPProposer(
        model, num_blocks, cache.block_size, config.scheduler.max_num_seqs, speculative.num_speculative_tokens,
        dev.dtype, dev.device, exclusive)
    grammars = lambda: Grammars(load_tokenizer(config.model), spec.vocab_size, spec.eos_token_ids)   # noqa: E731
    return AttentionWorker(rank, model, kv, sched, moe, max_model_len(config, spec), dev.device,
                           micro_batch_capacity(par.micro_batches, dev), speculative, draft, mtp, grammars)


def uses_decode_graphs(config: EngineConfig, dev: DeviceSettings) -> bool:
    """Decode graphs on this attention rank: on CUDA unless enforce_eager, with the Triton kernels (the torch
    decode would gather every row's whole max_model_len in a graph); on the CPU only as the tests' stand-in
    (AFSERVE_GRAPH_EMULATION=1, torch kernels: RecordedGraph records aten ops, which the C kernels bypass)."""
    if config.enforce_eager or config.scheduler.uses_mtp:     # (an MTP layer reads hidden states graphs do not keep)
        return False
    if dev.device.type == "cuda":
        return dev.kernel_backend == "triton"
    return os.environ.get("AFSERVE_GRAPH_EMULATION") == "1" and dev.kernel_backend == "torch"


def decode_graph_rows(config: EngineConfig) -> int:
    """The most decode rows one micro-batch can hold: max_num_seqs sequences, each with its speculative drafts,
    within the step's token budget (the largest bucket decode graphs capture, in the first micro-batch slot)."""
    return min(config.scheduler.max_num_seqs * (1 + decode_graph_drafts(config)),
               config.scheduler.max_num_batched_tokens)


def decode_graph_drafts(config: EngineConfig) -> int:
    """Speculative drafts per sequence in a decode step (0 without speculation)."""
    s = config.scheduler
    return s.speculative.num_speculative_tokens if s.speculative else 0


def draft_kv(speculative: SpeculativeConfig | None, spec: ModelSpec, config: EngineConfig) -> DraftKV | None:
    """The KV cache a speculative draft keeps beside the target's (the draft model's or the MTP layers'), which the
    KV budget holds too; None without one."""
    if speculative is None or speculative.method == "ngram":
        return None
    scratch = scratch_blocks(config.scheduler.max_num_seqs, speculative.num_speculative_tokens,
                             config.cache.block_size)
    if speculative.method == "mtp":
        return DraftKV(spec.num_mtp_layers, spec.kv_entry, scratch)
    draft = Checkpoint(speculative.model).spec
    return DraftKV(draft.num_layers, draft.kv_entry, scratch)


def draft_passes(config: EngineConfig) -> tuple[int, int | None]:
    """The leader's (MTP passes per step, disable_by_batch_size): (0, None) unless speculative method "mtp"."""
    s = config.scheduler.speculative
    return (s.num_speculative_tokens, s.disable_by_batch_size) if config.scheduler.uses_mtp else (0, None)


def load_draft_model(speculative: SpeculativeConfig, target: ModelSpec, dev: DeviceSettings, num_blocks: int,
                     block_size: int, max_num_seqs: int, exclusive=lambda block: False,
                     kv_cache_dtype: str = "auto") -> DraftModel:
    """speculative_config method "draft_model": the draft's whole checkpoint on this attention rank, its KV cache
    (of kv_cache_dtype, the option's value, as the target's) mirroring the target's blocks
    (attention_nodes/draft_model.py; exclusive(block): one sequence holds it)."""
    ckpt = Checkpoint(speculative.model)
    check_kv_dtype(ckpt.spec, dev, kv_cache_dtype)
    if ckpt.spec.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {speculative.model!r} has a vocabulary of {ckpt.spec.vocab_size} tokens "
                         f"and the target {target.vocab_size}: a draft must share the target's tokenizer")
    weights = ckpt.read(ckpt.attention_tensor_names(), dev.dtype, dev.device)
    model = AttentionModel(ckpt.spec, weights, dev.device, dev.kernel_backend)
    return DraftModel(model, num_blocks, block_size, max_num_seqs, speculative.num_speculative_tokens, dev.kv_dtype,
                      dev.device, exclusive)
