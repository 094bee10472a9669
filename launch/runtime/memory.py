"""GPU memory plan of the KV cache: vLLM's method, for ranks that may share a GPU.

On CUDA, with neither num_kv_blocks nor kv_cache_memory set, every rank of the launch
  1. loads its weights (and the data plane its receive buffers);
  2. runs a warm-up forward at the largest step and records its peak activations: an attention rank its
     model over max_num_batched_tokens tokens in max_num_seqs sequences (logits and a softmax per sequence;
     the experts replaced by zeros), plus, with decode graphs, what they will keep (`graph_reserve`), an
     expert rank its FFN over every token each attention rank may send;
  3. empties torch's cache, meets the others (a barrier on the control group), reads the GPU's used memory
     (all processes: contexts, weights, buffers) and shares (gpu, role, peak, used, total) with every rank.
Then each attention rank takes an equal share, among the attention ranks on its GPU, of
    gpu_memory_utilization x total - used - the peaks of every rank on that GPU.
The peaks are summed because co-located ranks compute at once (ping-pong overlaps attention and experts).
A start that finds no room fails with the numbers and what to change.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attention_nodes.batch import ForwardBatch
from attention_nodes.graphs import slot_sizes
from attention_nodes.kv_cache import KVCache
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import Sequence
from attention_nodes.step_plan import ScheduledSeq
from comm.shm import host_identity
from comm.stats import CommStats

logger = logging.getLogger("afserve")

MiB = 2**20


@dataclass(slots=True, frozen=True)
class GpuShare:
    """What one rank tells the others: its GPU, whether it holds a KV cache, its warm-up peak above what it
    keeps resident, and the GPU's used and total bytes when it looked (after every rank had loaded)."""

    gpu: str
    attention: bool
    peak: int
    used: int
    total: int


def kv_cache_bytes(me: int, shares: list[GpuShare], utilization: float) -> int:
    """Bytes of KV cache for rank `me` (an attention rank): its equal part, among the attention ranks on its
    GPU, of utilization x total - used - the peaks of every rank on that GPU. ValueError when nothing is
    left, naming the numbers."""
    mine = shares[me]
    if not mine.attention:
        raise ValueError(f"rank {me} is an expert rank: it holds no KV cache")
    same = [s for s in shares if s.gpu == mine.gpu]
    used = max(s.used for s in same)
    peaks = sum(s.peak for s in same)
    budget = int(utilization * mine.total) - used - peaks
    holders = sum(s.attention for s in same)
    if budget < holders * MiB:
        raise ValueError(
            f"no room for a KV cache on {mine.gpu}: gpu_memory_utilization={utilization} of "
            f"{mine.total / 2**30:.1f} GiB is {utilization * mine.total / 2**30:.2f} GiB, but {len(same)} rank(s) "
            f"there already use {used / 2**30:.2f} GiB (weights, buffers, CUDA contexts) and their warm-up "
            f"forwards peak at {peaks / 2**30:.2f} GiB more; raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens or max_num_seqs, put fewer ranks on one GPU, or set kv_cache_memory")
    return budget // holders


class NoExperts:
    """A MoEContext stand-in for the warm-up forward: the routed experts' output is zeros (its memory is the
    real one's: one `[T, H]` tensor), and the compute timers go to a throwaway CommStats."""

    class _Dispatcher:
        def __init__(self) -> None:
            self.stats = CommStats(max_events=1)

    def __init__(self) -> None:
        self.dispatcher = NoExperts._Dispatcher()

    def start(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def finish(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


def warmup_batch(num_tokens: int, num_seqs: int, max_len: int, block_size: int, device: torch.device,
                 kernel_backend: str) -> tuple[ForwardBatch, int]:
    """The largest step a rank may run, as prefill chunks: num_tokens tokens over at most num_seqs sequences
    of at most max_len tokens, each sampling -> (batch, KV blocks it writes)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [min(max_len, num_tokens // num_seqs + (i < num_tokens % num_seqs)) for i in range(num_seqs)]
    scheduled, block = [], 0
    for i, n in enumerate(lengths):
        seq = Sequence.from_request(f"warmup-{i}", [i % 2] * n, SamplingParams(max_tokens=1), i)
        blocks = -(-n // block_size)
        seq.block_table = list(range(block, block + blocks))
        block += blocks
        scheduled.append(ScheduledSeq.from_seq(seq, n))
    return ForwardBatch.from_scheduled(scheduled, block_size, device, kernel_backend), block


class PeakMeter:
    """The device's allocation peak over a region, above what was allocated when it started (torch's CUDA
    caching allocator statistics). On CPU it measures nothing (0): torch keeps no CPU allocator peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def peak(self) -> int:
        if self.device.type != "cuda":
            return 0
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)


@torch.inference_mode()
def attention_peak(model, spec, num_tokens: int, num_seqs: int, max_len: int, block_size: int,
                   kv_dtype: torch.dtype) -> int:
    """Peak bytes of an attention rank's warm-up forward at its largest step (see warmup_batch), above a
    scratch KV cache (of kv_dtype) just large enough for it."""
    batch, blocks = warmup_batch(num_tokens, num_seqs, max_len, block_size, model.device, model.kernel_backend)
    scratch = KVCache(spec.num_layers, blocks, block_size, spec.kv_entry, kv_dtype, model.device)
    with PeakMeter(model.device) as meter:
        logits = model.forward([batch], scratch, NoExperts())
        F.softmax(logits, dim=-1)
    return meter.peak


def graph_reserve(model, spec, rows: int, slots: int, block_size: int, max_len: int, dtype: torch.dtype,
                  drafts: int = 0, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes an attention rank's decode graphs (attention_nodes/graphs.py) keep, counted in its peak so the KV cache
    leaves room for them: per micro-batch slot, at its largest bucket (graphs.slot_rows of `rows` decode rows with
    `drafts` drafts each), a memory pool of about one forward's peak (measured as attention_peak's) and its
    buffers, per row: each MoE layer's dispatched row with its ids and weights, the combine's output, fp32 logits,
    and the static inputs (a block-table row of max_len's blocks)."""
    item = torch.empty(0, dtype=dtype).element_size()
    H, width = spec.hidden_size, -(-max_len // block_size)
    per_row = spec.num_moe_layers * (H * item + 16 * spec.top_k) + H * item + 4 * spec.vocab_size + 4 * width + 48
    tops = [slot_sizes(rows, j, drafts)[-1] for j in range(slots)]
    pools = {top: attention_peak(model, spec, top, top, 1, block_size, kv_dtype or dtype) for top in set(tops)}
    return sum(pools[top] + top * per_row for top in tops)


@torch.inference_mode()
def expert_peak(slots, num_rows: int, top_k: int, hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> int:
    """Peak bytes of an expert rank's FFN over num_rows received rows (every token each attention rank may
    send in a step), each choosing top_k of its slots."""
    if slots.num_slots == 0 or num_rows == 0:
        return 0
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(num_rows, hidden_size, generator=g).to(device=device, dtype=dtype)
    picks = torch.randint(0, slots.num_slots, (num_rows, top_k), generator=g).to(device)
    weights = torch.rand(num_rows, top_k, generator=g).to(device)
    with PeakMeter(device) as meter:
        slots.ffn(0, x, picks, weights)
    return meter.peak


def gpu_name(device: torch.device) -> str:
    """This rank's GPU, the same string in every process using it: the machine (comm.shm.host_identity, as the
    data plane tells hosts apart) and the device's UUID."""
    props = torch.cuda.get_device_properties(device)
    return f"{host_identity()}/{getattr(props, 'uuid', device.index)}"


def measure_share(device: torch.device, attention: bool, peak: int) -> GpuShare:
    """This rank's GpuShare, read now: call it once every rank on the GPU has loaded, warmed up and emptied
    torch's cache (torch.cuda.empty_cache, then a barrier)."""
    free, total = torch.cuda.mem_get_info(device)
    return GpuShare(gpu_name(device), attention, peak, total - free, total)


def plan(device: torch.device, attention: bool, peak: int, group, utilization: float) -> int | None:
    """Step 3 above, once this rank has loaded and warmed up: after a barrier of `group`'s ranks (all loaded,
    caches emptied; None: a rank that starts alone) each reads its GPU's use, the ranks share what they read, and
    an attention rank gets its KV bytes (an expert rank None)."""
    torch.cuda.empty_cache()
    if group is not None:
        dist.barrier(group=group)
    share = measure_share(device, attention, peak)
    shares, me = [share], 0
    if group is not None:
        shares = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, share, group=group)
        me = dist.get_rank(group)
    if not attention:
        return None
    kv = kv_cache_bytes(me, shares, utilization)
    logger.info("GPU memory plan: %s used %.2f GiB of %.2f, warm-up peaks %s MiB; KV cache %.2f GiB",
                share.gpu, share.used / 2**30, share.total / 2**30,
                [s.peak >> 20 for s in shares if s.gpu == share.gpu], kv / 2**30)
    return kv
