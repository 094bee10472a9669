"""Device and memory sizing of one rank: which device, dtype, kernels and threads it runs with, how many KV
blocks its cache and host tier hold, and how many bytes of expert weights it may take."""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch

from attention_nodes.kv_cache import block_bytes, num_blocks_for
from expert_nodes.slots import ExpertSlots
from kernels.ops import resolve_backend
from models.spec import ModelSpec

from ..config import CacheConfig, EngineConfig

CPU_KV_DEFAULT_BYTES = 256 << 20


@dataclass(slots=True, frozen=True)
class DeviceSettings:
    """Where this rank computes: device, activation dtype, kernel backend and the data plane's backend."""

    device: torch.device
    dtype: torch.dtype
    kernel_backend: str
    backend: str                # torch.distributed backend: nccl on CUDA, gloo on CPU or on GPUs shared by ranks
    gpu_sharers: int = 1        # ranks of this node on this rank's GPU (1: a GPU of its own)
    gpus: int = 0               # GPUs this rank's machine shows it
    kv_dtype: torch.dtype | None = None   # what the KV cache stores (kv_cache_dtype); None: dtype

    def __post_init__(self) -> None:
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @property
    def node_shares_gpus(self) -> bool:
        """Whether this node's ranks share its GPUs (then every rank of the node runs gloo, even one alone on
        its GPU, and only the cuda_ipc transport carries the data plane)."""
        return self.device.type == "cuda" and self.backend == "gloo"


def gpu_placement(local_rank: int, local_world_size: int, device_count: int, transport: str, comm: str,
                  one_node: bool) -> tuple[int, int]:
    """CUDA: (this rank's GPU index, ranks of the node on that GPU). One GPU per rank (by LOCAL_RANK) when the
    node has enough; otherwise the node's ranks share its GPUs round-robin, which only the cuda_ipc transport
    can carry (NCCL refuses two ranks of one communicator on one GPU). ValueError names the numbers."""
    if device_count < 1:
        raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}")
    if local_world_size <= device_count:
        return local_rank, 1
    index = local_rank % device_count
    sharers = len(range(index, local_world_size, device_count))
    need = (f"{local_world_size} ranks on this node but {device_count} GPU(s): NCCL needs a GPU per rank")
    if transport not in ("auto", "cuda_ipc"):
        raise ValueError(f"{need}; ranks can share GPUs only with transport='cuda_ipc' (transport={transport!r}), "
                         f"or launch at most {device_count} ranks per node")
    if comm != "direct" or not one_node:
        raise ValueError(f"{need}; ranks sharing GPUs talk through cuda_ipc, which carries comm='direct' on one node "
                         f"only (comm={comm!r}, one node: {one_node}); launch at most {device_count} ranks per node")
    return index, sharers


def gpu_backend(local_world_size: int, device_count: int) -> str:
    """The process groups' backend of a CUDA node's ranks, the same on each of them: nccl when every rank has a
    GPU of its own, else gloo, also for a rank alone on its GPU (3 ranks on 2 GPUs: GPU 1's rank would
    otherwise pick nccl while the ranks sharing GPU 0 pick gloo, and the groups could not form)."""
    return "nccl" if local_world_size <= device_count else "gloo"


def set_device(config: EngineConfig, world_size: int) -> DeviceSettings:
    """Pick this rank's device (CUDA: gpu_placement by LOCAL_RANK) and, on CPU, its threads (threads_per_rank,
    else the machine's cores shared by the job's ranks) and allocator behaviour."""
    if config.device_type() == "cuda":
        par = config.parallel
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        one_node = (par.ranks_per_node or local_world) >= world_size
        gpus = torch.cuda.device_count()
        index, sharers = gpu_placement(int(os.environ.get("LOCAL_RANK", "0")), local_world, gpus, par.transport,
                                       par.comm, one_node)
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        backend = gpu_backend(local_world, gpus)
    else:
        device, sharers, backend, gpus = torch.device("cpu"), 1, "gloo", 0
        tune_allocator()
        cores = os.cpu_count() or 1
        torch.set_num_threads(config.threads_per_rank or max(1, cores // world_size))
    dtype = config.torch_dtype(device)
    kernels, kv_dtype = resolve_backend(config.kernel_backend, device), config.cache.kv_torch_dtype(dtype)
    if device.type == "cuda" and kv_dtype == torch.float8_e4m3fn:     # (asks the driver only then)
        check_fp8_kernels(kv_dtype, kernels, torch.cuda.get_device_capability(device), config.cache.kv_cache_dtype)
    return DeviceSettings(device, dtype, kernels, backend, sharers, gpus, kv_dtype)


def check_fp8_kernels(kv_dtype: torch.dtype, kernel_backend: str, capability: tuple[int, int], option: str) -> None:
    """Triton converts e4m3 (its fp8e4nv) only on GPUs of compute capability 8.9 and later: refuse it before any
    kernel compiles on an older one, naming kv_cache_dtype's value (option) and the GPU's capability."""
    if kv_dtype == torch.float8_e4m3fn and kernel_backend == "triton" and tuple(capability) < (8, 9):
        raise ValueError(f"kv_cache_dtype={option!r} (float8 e4m3) needs a GPU of compute capability 8.9 or later "
                         f"for the Triton kernels (this one: {capability[0]}.{capability[1]}): use "
                         f"kv_cache_dtype='fp8_e5m2' or 'auto', or kernel_backend='sdpa'")


def host_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_micro_batches(dev: DeviceSettings, ranks_on_host: int, cores: int) -> int:
    """micro_batches=0 (auto), the leader's choice: 2 (ping-pong) where every rank has a core or a GPU of its
    own, else 1. Ping-pong overlaps one micro-batch's attention with the other's experts, which pays only when
    both run at once; ranks that time-share a core or a GPU split each op's cost instead, and the extra
    exchanges then cost more than the overlap saves. Measured (docs/benchmarks.md, "Ping-pong when the ranks
    share cores"): on 2 cores, 1+1 offline 12-28% faster with 2; 1+2 offline 10-16% faster with 1 on repeated
    prompts and the same on fresh ones, 2+1 14% faster with 1; one GPU shared by 1+1 through cuda_ipc, 13-30%
    faster with 1. serve.py's HTTP front is not counted: 1+1 served beside it was 16-30% faster with 1 in one
    session, the same or up to 15% slower in ten pairs the next. ranks_on_host: the job's ranks on the leader's
    machine."""
    if dev.device.type == "cuda":
        return micro_batch_capacity(0, dev)    # 1 where the node's ranks share GPUs, else 2
    return 2 if cores >= ranks_on_host else 1


def micro_batch_capacity(micro_batches: int, dev: DeviceSettings) -> int:
    """The most micro-batches a step may run, which every rank sizes for (data-plane rounds in flight, decode
    graph slots and their memory, an expert rank's exchanges): micro_batches, or with 0 (auto) the most that
    auto_micro_batches can pick: 1 where the node's ranks share GPUs (a job of that one node, whose ranks all
    see the same), else 2."""
    return micro_batches or (1 if dev.node_shares_gpus else 2)


DECODE_THREADS_MAX = 16   # the default's cap: the decode is memory-bound, and a wake-up per thread costs per call


def decode_threads(config: EngineConfig) -> int:
    """Threads of an attention rank's C paged decode: decode_threads, else the cores this process may run on
    shared by the attention ranks (at most DECODE_THREADS_MAX). The expert ranks' cores are counted in on
    purpose: on a CPU an expert rank waits while the attention ranks compute attention (measured on the 2-core
    VM at 1+1: ~60% of its time), so the decode, memory-bound, borrows them; its threads poll briefly,
    yielding, then sleep."""
    if config.decode_threads:
        return config.decode_threads
    return max(1, min(DECODE_THREADS_MAX, host_cores() // config.parallel.attention_ranks))


def tune_allocator() -> None:
    """Linux/glibc: keep freed memory in the heap instead of returning it to the kernel. The forward and the
    dispatchers free and re-allocate the same multi-MB temporaries every layer; returned memory page-faults
    anew on its next use (measured: decode attention 4x slower). Blocks over 32 MiB (glibc's largest mmap
    threshold) would still be mmap'd and unmapped each time, so mmap'd blocks are switched off: a 4096-token
    two_phase layer (hidden 2048) took ~74k page faults on a gateway and 240-350 ms with them, 0 and
    95-130 ms without (4 gloo ranks on loopback, 2 cores)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD: largest allowed value on 64-bit
        libc.mallopt(-4, 0)          # M_MMAP_MAX: no mmap'd blocks, whatever their size
        libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD: give back only a free top of 1 GiB or more


def max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The longest sequence served: the configured limit within the model's positions."""
    return min(config.scheduler.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)


def plans_gpu_memory(cache: CacheConfig, dev: DeviceSettings) -> bool:
    """Whether start-up runs the GPU memory plan (launch/runtime/memory.py): on CUDA, with the KV cache's size
    not configured (num_kv_blocks and kv_cache_memory unset). The same answer on every rank of a launch."""
    return dev.device.type == "cuda" and cache.num_kv_blocks is None and cache.kv_cache_memory is None


@dataclass(frozen=True, slots=True)
class DraftKV:
    """A speculative draft's KV cache beside the target's (the draft model's, or the MTP layers'): one block per
    target block (it mirrors the target's block ids) plus `scratch` blocks of its own, each `layers` layers of
    `entry` (KVCache's)."""
    layers: int
    entry: tuple[int, int, int]
    scratch: int


def num_kv_blocks(cache: CacheConfig, spec: ModelSpec, dev: DeviceSettings, planned: int | None = None,
                  draft: DraftKV | None = None) -> int:
    """Blocks of the device KV pool: num_kv_blocks, else what fits in kv_cache_memory bytes, else on CUDA in the
    memory plan's `planned` bytes, else in 256 MiB (CPU). The bytes hold the draft's cache too, when there is one
    (its mirror of every block and its scratch blocks)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    memory = cache.kv_cache_memory
    if memory is None:
        if plans_gpu_memory(cache, dev):
            if planned is None:
                raise RuntimeError("the KV cache on CUDA is sized by the GPU memory plan, which did not run")
            memory = planned
        else:
            memory = CPU_KV_DEFAULT_BYTES
    if draft is None:
        return num_blocks_for(memory, spec.num_layers, cache.block_size, spec.kv_entry, dev.kv_dtype)
    mirror = block_bytes(draft.layers, cache.block_size, draft.entry, dev.kv_dtype)
    per_block = block_bytes(spec.num_layers, cache.block_size, spec.kv_entry, dev.kv_dtype) + mirror
    n = (memory - draft.scratch * mirror) // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory={memory} bytes holds no KV block beside the speculative draft's cache "
                         f"({per_block} bytes a block with the draft's mirror, plus {draft.scratch} scratch blocks "
                         f"of {mirror}): give more memory")
    return int(n)


def num_host_blocks(cache: CacheConfig, spec: ModelSpec, dtype: torch.dtype) -> int:
    """Blocks of the host KV tier: kv_offload_memory bytes in the device pool's block layout (0: off)."""
    if not cache.kv_offload_memory:
        return 0
    return num_blocks_for(cache.kv_offload_memory, spec.num_layers, cache.block_size, spec.kv_entry, dtype,
                          "kv_offload_memory")


def expert_budget(expert_memory: int | None, slots: ExpertSlots, device: torch.device) -> int:
    """Bytes of expert weights an expert rank may hold: expert_memory, else what it holds plus what is free
    (device memory on CUDA, the host's available memory on CPU)."""
    if expert_memory is not None:
        return expert_memory
    held = slots.num_bytes()
    if device.type == "cuda":
        return held + torch.cuda.mem_get_info(device)[0]
    return held + host_available_bytes()


def check_expert_memory(rank: int, num_slots: int, bytes_per_slot: int, expert_memory: int | None) -> None:
    """ValueError when num_slots experts do not fit in expert_memory bytes (None: no limit)."""
    need = num_slots * bytes_per_slot
    if expert_memory is not None and need > expert_memory:
        raise ValueError(f"expert rank {rank}: {num_slots} expert slots need {need / 2**20:.1f} MiB but "
                         f"expert_memory={expert_memory} ({expert_memory / 2**20:.1f} MiB); raise expert_memory or "
                         f"add expert ranks")


def host_available_bytes() -> int:
    """Linux: MemAvailable from /proc/meminfo; elsewhere a large number (no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62
