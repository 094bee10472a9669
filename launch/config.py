"""The configuration tree. Only top-level objects (the runtime, the LLM front) see all of it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import torch

from kernels.ops import resolve_backend

COMM_MODES = ("direct", "two_phase", "auto")
BALANCERS = ("static", "round_robin", "random", "least_loaded")
TRANSPORTS = ("auto", "shm", "collective")


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: pass an integer >= {minimum}")
    return value


@dataclass(slots=True)
class ParallelConfig:
    attention_ranks: int = 1
    expert_ranks: int = 1
    ranks_per_node: int | None = None   # None: from torchrun's LOCAL_WORLD_SIZE (or all ranks on one node)
    comm: str = "direct"
    balancer: str = "static"
    micro_batches: int = 1              # >1: ping-pong, attention computes one while the experts serve another
    transport: str = "auto"             # CPU data plane: shm (same host, one node), collective (gloo), auto
    redundant_experts: int = 0          # extra expert slots in all, for replicas of the busiest experts
    rebalance_interval: int = 0         # every N steps recompute the placement from observed load; 0 = never
    comm_calibration: str | None = None  # auto: load the alpha-beta calibration from this JSON, or measure and save
    expert_memory: int | None = None    # bytes of expert weights one expert rank may hold; None: what the device has

    def __post_init__(self) -> None:
        _int("attention_ranks", self.attention_ranks, 1)
        _int("micro_batches", self.micro_batches, 1)
        _int("expert_ranks", self.expert_ranks, 1)
        _int("redundant_experts", self.redundant_experts, 0)
        _int("rebalance_interval", self.rebalance_interval, 0)
        if self.expert_memory is not None:
            _int("expert_memory", self.expert_memory, 1)
        if self.ranks_per_node is not None:
            _int("ranks_per_node", self.ranks_per_node, 1)
        if self.comm not in COMM_MODES:
            raise ValueError(f"comm={self.comm!r} is invalid: choose one of {COMM_MODES}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is invalid: choose one of {TRANSPORTS}")
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer={self.balancer!r} is invalid: choose one of {BALANCERS}")

    @property
    def world_size(self) -> int:
        return self.attention_ranks + self.expert_ranks


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes per attention rank; None: 256 MiB on CPU, 80% of free on CUDA
    num_kv_blocks: int | None = None    # overrides kv_cache_memory (tests use it to force preemption)
    enable_prefix_caching: bool = True  # reuse cached full blocks of earlier prompts (and route to them)
    kv_offload_memory: int = 0          # bytes of host memory per attention rank for evicted cached blocks; 0 = off

    def __post_init__(self) -> None:
        _int("block_size", self.block_size, 1)
        _int("kv_offload_memory", self.kv_offload_memory, 0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} is invalid: pass True or False")
        if self.kv_offload_memory and not self.enable_prefix_caching:
            raise ValueError(f"kv_offload_memory={self.kv_offload_memory} needs prefix caching, which holds what the "
                             f"host tier keeps: drop enable_prefix_caching=False or set kv_offload_memory=0")
        if self.kv_cache_memory is not None:
            _int("kv_cache_memory", self.kv_cache_memory, 1)
        if self.num_kv_blocks is not None:
            _int("num_kv_blocks", self.num_kv_blocks, 1)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None    # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _int("max_model_len", self.max_model_len, 1)


@dataclass(slots=True)
class EngineConfig:
    model: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "auto"                 # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                # auto: cuda when available, else cpu
    kernel_backend: str = "auto"        # auto: Triton kernels on CUDA, torch references on CPU
    threads_per_rank: int | None = None  # CPU threads per rank; None: cores / world size
    collective_timeout_s: float = 600.0
    heartbeat_s: float = 1.0            # an idle leader broadcasts at least this often
    rank_failure_s: float = 3.0         # a rank whose heartbeat thread is silent this long counts as dead
    startup_timeout_s: float = 300.0
    load_progress: bool = True          # tqdm bar of weight bytes read, on the first rank of each role
    # Separate pool launches (launch/step_protocol.py, "Joining"): this process's pool and the store that the
    # pools rendezvous through, which the attention pool's first rank (the leader) serves. None: roles by rank.
    role: str | None = None             # "attention" or "expert"
    pool_addr: str | None = None        # "HOST:PORT"
    leader_host: str | None = None      # the host whose attention rank 0 leads (None: attention rank 0 of any)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} is invalid: choose auto, float32, bfloat16 or float16")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is invalid: choose auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
        resolve_backend(self.kernel_backend, self.device_type())   # an unknown or unrunnable kernel_backend raises
        for name in ("collective_timeout_s", "heartbeat_s", "startup_timeout_s", "rank_failure_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{name}={v!r} is invalid: pass a positive number of seconds")
        if self.threads_per_rank is not None:
            _int("threads_per_rank", self.threads_per_rank, 1)
        if self.role not in (None, "attention", "expert"):
            raise ValueError(f"role={self.role!r} is invalid: choose attention or expert")
        if (self.role is None) != (self.pool_addr is None):
            raise ValueError(f"role={self.role!r} and pool_addr={self.pool_addr!r}: separate pool launches need "
                             f"both (--role attention|expert --pool-addr HOST:PORT), a single launch neither")
        if self.pool_addr is not None:
            self.pool_host_port()
        if self.heartbeat_s >= self.collective_timeout_s:
            raise ValueError(f"heartbeat_s={self.heartbeat_s} must be below collective_timeout_s="
                             f"{self.collective_timeout_s}: idle ranks would time out between heartbeats")

    @classmethod
    def from_options(cls, model: str, attention_ranks: int, expert_ranks: int, **options) -> EngineConfig:
        """Flat keyword options (as LLM(...) and the CLI take them) -> the config tree."""
        groups = {ParallelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
        top = {}
        owner = {f.name: c for c in groups for f in fields(c)}
        top_names = {f.name for f in fields(cls)} - {"model", "parallel", "cache", "scheduler"}
        for k, v in options.items():
            if k in owner:
                groups[owner[k]][k] = v
            elif k in top_names:
                top[k] = v
            else:
                valid = sorted(set(owner) | top_names)
                raise ValueError(f"unknown option {k!r}; valid options: {', '.join(valid)}")
        groups[ParallelConfig].update(attention_ranks=attention_ranks, expert_ranks=expert_ranks)
        return cls(model=str(model), parallel=ParallelConfig(**groups[ParallelConfig]),
                   cache=CacheConfig(**groups[CacheConfig]), scheduler=SchedulerConfig(**groups[SchedulerConfig]),
                   **top)

    def pool_host_port(self) -> tuple[str, int]:
        """pool_addr "HOST:PORT" -> (host, port); ValueError names a malformed one."""
        host, _, port = (self.pool_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"pool_addr={self.pool_addr!r} is invalid: pass HOST:PORT, the address the attention "
                             f"pool's first rank serves the job's store on (e.g. 10.0.0.5:29400)")
        return host, int(port)

    def leader_settings(self) -> dict:
        """What a joining rank takes from the leader's config, so that every rank of the job agrees: the
        parallel, cache and scheduler settings, dtype, kernels and timeouts. Its model path, device, threads
        and start-up timeout stay its own."""
        return {"parallel": asdict(self.parallel), "cache": asdict(self.cache), "scheduler": asdict(self.scheduler),
                **{k: getattr(self, k) for k in ("dtype", "kernel_backend", "collective_timeout_s", "heartbeat_s",
                                                 "rank_failure_s")}}

    def with_leader_settings(self, settings: dict) -> EngineConfig:
        return replace(self, parallel=ParallelConfig(**settings["parallel"]), cache=CacheConfig(**settings["cache"]),
                       scheduler=SchedulerConfig(**settings["scheduler"]),
                       **{k: v for k, v in settings.items() if k not in ("parallel", "cache", "scheduler")})

    def device_type(self) -> str:
        """"cuda" or "cpu"; the runtime picks the CUDA index from LOCAL_RANK."""
        return "cuda" if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()) else "cpu"

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
