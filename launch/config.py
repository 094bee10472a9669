"""The configuration tree. Only top-level objects (the runtime, the LLM front) see all of it.

It is also the one declaration of every engine option: each field below is an option with its default, and
its metadata holds the help text, the choices where there are some, and where the command line differs
(flag: another flag name; flag_default, flag_default_text: the flag's default when it is not the field's).
launch/options.py reads it for the flags (launch/cli.py), the options table and the LLM(...) keywords.
"""
from __future__ import annotations

import os
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace

import torch

from attention_nodes.scheduler import POLICIES as SCHEDULING_POLICIES
from attention_nodes.speculation import SpeculativeConfig
from kernels.ops import BACKENDS as KERNEL_BACKENDS
from kernels.ops import resolve_backend
from models import SHIPPED_MODEL

COMM_MODES = ("direct", "two_phase", "auto")
BALANCERS = ("static", "round_robin", "random", "least_loaded")
TRANSPORTS = ("auto", "shm", "cuda_ipc", "collective")
IN_BAND_COUNTS = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# the KV cache's float8 formats (vLLM's names; "fp8" is e4m3), cast without a scale
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
ROLES = ("attention", "prefill", "decode", "expert")
ATTENTION_ROLES = ("attention", "prefill", "decode")   # prefill, decode: an attention rank joining PD's pool


def option(default=MISSING, help: str = "", **meta) -> Field:
    """A config field that is an engine option: its default, help text and any choices/flag metadata."""
    return field(default=default, metadata={"help": help, **meta})


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: pass an integer >= {minimum}")
    return value


@dataclass(slots=True)
class ParallelConfig:
    attention_ranks: int = option(1, "ranks that run attention and hold the KV cache; attention rank 0 leads")
    prefill_ranks: int = option(0, "PD on AF: this many of the attention ranks (the first) only prefill and the "
                                   "others only decode, a request moving with its KV at the end of its prefill "
                                   "(0: every attention rank does both)")
    max_decode_passes: int = option(1, "PD: the most forwards a decode rank runs in a step while each prefill "
                                       "rank runs one (its MoE layers spread over theirs), the leader sizing each "
                                       "step's from measured times (e.g. 8); 1: decode and prefill ranks in "
                                       "lockstep (on ranks sharing CPU cores the passes lengthen TTFT without "
                                       "lowering TPOT: measured)")
    stream_kv: bool = option(True, "PD with prefix caching: a request's prompt KV goes to its decode rank block by "
                                   "block as its prefill chunks complete (into that rank's prefix cache), so that "
                                   "its move sends only what its last chunk added; False: every block at the move")
    expert_ranks: int = option(1, "ranks that hold the experts and compute them", flag_default=None,
                               flag_default_text="world size - attention ranks under torchrun, 2 otherwise")
    ranks_per_node: int | None = option(None, "ranks per node (default: torchrun's LOCAL_WORLD_SIZE, or all "
                                              "ranks on one node)")
    comm: str = option("direct", "MoE dispatch and combine: direct, two_phase (aggregated per node, one "
                                 "exchange per node pair) or auto (per call, whichever the cost model predicts "
                                 "faster)", choices=COMM_MODES)
    balancer: str = option("static", "which replica of an expert a token goes to", choices=BALANCERS)
    micro_batches: int = option(0, "ping-pong micro-batches per step (>1: attention computes one while the "
                                   "experts serve another; 1: never split; 0, auto: 2 where every rank has a "
                                   "core or a GPU of its own, else 1)")
    micro_batch_min_tokens: int = option(16, "with micro_batches > 1, split a step only when every attention "
                                             "rank runs at least this many tokens per micro-batch (else one "
                                             "batch)")
    transport: str = option("auto", "data plane of comm='direct' on one node: host shared memory between CPU "
                                    "ranks (shm), device buffers shared through CUDA IPC between GPU ranks "
                                    "(cuda_ipc; lets ranks share a GPU), gloo/NCCL collectives (collective), "
                                    "or auto (shm or cuda_ipc when they can, else collective)",
                            choices=TRANSPORTS)
    in_band_counts: str = option("auto", "the same-host transports with two or more expert ranks: each source's "
                                         "row count travels in its message (a place per token of the batch, "
                                         "placed on the device), not read back to the host per layer (on), or "
                                         "exact-size messages counted on the host (off); auto: on with CUDA "
                                         "(cuda_ipc), off on CPU (shm), where the host read is free",
                                 choices=IN_BAND_COUNTS)
    cuda_ipc_events: bool = option(False, "transport cuda_ipc: a sender marks each message's copy done with a CUDA "
                                          "IPC event that the receiver's stream waits for, instead of synchronizing "
                                          "its stream before posting it (no host wait in a dispatch or combine; "
                                          "every rank the same and on one GPU; not yet run on a GPU, and a peer "
                                          "killed between posting and its copy could leave a survivor's stream "
                                          "waiting, which the heartbeat then exits, hence off by default)")
    redundant_experts: int = option(0, "extra expert slots in all, for replicas of the busiest experts")
    rebalance_interval: int = option(0, "recompute the expert placement from observed load every N steps "
                                        "(0: never)")
    rebalance_max_slots: int = option(0, "live re-placement moves at most this many expert slots per MoE layer "
                                         "each time, on the layers whose predicted max/mean load is above 1.10 "
                                         "(incremental: cheap enough for rebalance_interval=1, bytes bounded); 0: "
                                         "EPLB from scratch each time")
    autoscale: str | None = option(None, "a step-cost profile (python -m launch.plan --calibrate --save-profile "
                                         "FILE): move ranks between the attention and expert pools, keeping their "
                                         "total, when its model, scaled by the last window's measured times, "
                                         "predicts a split at least autoscale_margin faster; ranks spawned by LLM "
                                         "or serve.py's, without PD")
    autoscale_window: int = option(64, "autoscale: steps per measured window, and the steps left unmeasured after "
                                       "the pools change")
    autoscale_margin: float = option(0.15, "autoscale: the least predicted step-time gain that moves ranks")
    comm_calibration: str | None = option(None, "comm=auto: alpha-beta calibration JSON to load (or to write "
                                                "after measuring)")
    expert_memory: int | None = option(None, "bytes of expert weights one expert rank may hold (default: what "
                                             "the device has)")

    def __post_init__(self) -> None:
        _int("attention_ranks", self.attention_ranks, 1)
        _int("micro_batches", self.micro_batches, 0)
        _int("micro_batch_min_tokens", self.micro_batch_min_tokens, 0)
        _int("expert_ranks", self.expert_ranks, 1)
        _int("prefill_ranks", self.prefill_ranks, 0)
        _int("max_decode_passes", self.max_decode_passes, 1)
        if self.prefill_ranks and self.prefill_ranks >= self.attention_ranks:
            raise ValueError(f"prefill_ranks={self.prefill_ranks} with attention_ranks={self.attention_ranks} leaves "
                             f"no decode rank: pass prefill_ranks below attention_ranks (e.g. "
                             f"attention_ranks={self.prefill_ranks + 1}), or 0 for no PD")
        _int("redundant_experts", self.redundant_experts, 0)
        _int("rebalance_interval", self.rebalance_interval, 0)
        _int("rebalance_max_slots", self.rebalance_max_slots, 0)
        _int("autoscale_window", self.autoscale_window, 1)
        if isinstance(self.autoscale_margin, bool) or not isinstance(self.autoscale_margin, (int, float)) \
                or not 0 <= self.autoscale_margin < 1:
            raise ValueError(f"autoscale_margin={self.autoscale_margin!r} is invalid: pass a fraction in [0, 1), "
                             "the least predicted gain a move needs")
        if self.autoscale is not None and (not isinstance(self.autoscale, str) or not self.autoscale):
            raise ValueError(f"autoscale={self.autoscale!r} is invalid: pass the path of a step-cost profile "
                             "(python -m launch.plan --calibrate --save-profile FILE), or None for no autoscaler")
        if self.autoscale is not None and self.prefill_ranks:
            raise ValueError(f"autoscale with prefill_ranks={self.prefill_ranks}: the autoscaler sizes one "
                             "attention pool against the expert pool; pass prefill_ranks=0, or autoscale=None")
        if self.expert_memory is not None:
            _int("expert_memory", self.expert_memory, 1)
        if self.ranks_per_node is not None:
            _int("ranks_per_node", self.ranks_per_node, 1)
        if self.comm not in COMM_MODES:
            raise ValueError(f"comm={self.comm!r} is invalid: choose one of {COMM_MODES}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is invalid: choose one of {TRANSPORTS}")
        if self.in_band_counts not in IN_BAND_COUNTS:
            raise ValueError(f"in_band_counts={self.in_band_counts!r} is invalid: choose one of {IN_BAND_COUNTS}")
        if not isinstance(self.cuda_ipc_events, bool):
            raise ValueError(f"cuda_ipc_events={self.cuda_ipc_events!r} is invalid: pass True or False")
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer={self.balancer!r} is invalid: choose one of {BALANCERS}")

    @property
    def world_size(self) -> int:
        return self.attention_ranks + self.expert_ranks


@dataclass(slots=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory: int | None = option(None, "bytes of KV cache per attention rank (default: 256 MiB on CPU; "
                                               "on CUDA, sized by gpu_memory_utilization)")
    gpu_memory_utilization: float = option(0.9, "CUDA: share of each GPU's total memory the ranks on it may use; "
                                                "the KV cache gets what weights, buffers and a warm-up forward's "
                                                "peak leave, split among the GPU's attention ranks")
    num_kv_blocks: int | None = option(None, "KV cache blocks per attention rank; overrides kv_cache_memory "
                                             "(tests use it to force preemption)")
    enable_prefix_caching: bool = option(True, "reuse cached full blocks of earlier prompts, and route requests "
                                               "to the rank caching them (--no-prefix-caching turns it off)",
                                         flag="--no-prefix-caching")
    kv_offload_memory: int = option(0, "bytes of host memory per attention rank for KV blocks evicted from the "
                                       "prefix cache (0: off)")
    kv_cache_dtype: str = option("auto", "what the KV cache stores: auto (the model's dtype), or fp8 / fp8_e4m3 / "
                                         "fp8_e5m2 (vLLM's: keys and values cast to float8 as written, without a "
                                         "scale, and back as read; 2x the blocks of bf16, 4x of fp32; not for MLA "
                                         "models)", choices=tuple(KV_CACHE_DTYPES))

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
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization={u!r} is invalid: pass a fraction of the GPU's memory in "
                             f"(0, 1], e.g. 0.9")
        if self.num_kv_blocks is not None:
            _int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is invalid: choose one of "
                             f"{tuple(KV_CACHE_DTYPES)}")

    def kv_torch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype where the model computes in dtype."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or dtype


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = option(64, "most sequences scheduled at once")
    max_num_batched_tokens: int = option(512, "most tokens in one step, prompt chunks and decodes together")
    scheduling_policy: str = option("fcfs", "which waiting request is admitted first and which running one is "
                                            "preempted when KV blocks run out: fcfs (the earliest arrival; the "
                                            "newest), or priority (vLLM's: the lowest SamplingParams.priority, "
                                            "ties by arrival; the highest)", choices=SCHEDULING_POLICIES)
    max_model_len: int | None = option(None, "most tokens of one sequence, prompt and output (default: the "
                                             "model's max_position_embeddings)")
    speculative_config: dict | None = option(None, "speculative decoding, vLLM's keys (JSON on the command line): "
                                                   "{\"method\": \"ngram\", \"num_speculative_tokens\": k, "
                                                   "\"prompt_lookup_min\": a, \"prompt_lookup_max\": b} or "
                                                   "{\"method\": \"draft_model\", \"model\": DIR, "
                                                   "\"num_speculative_tokens\": k} or {\"method\": \"mtp\", "
                                                   "\"num_speculative_tokens\": k} (the checkpoint's DeepSeek "
                                                   "multi-token-prediction layers), each with "
                                                   "\"disable_by_batch_size\": n; each running request's "
                                                   "drafts are verified in the next step with it (None: off)")

    def __post_init__(self) -> None:
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is invalid: choose one of "
                             f"{SCHEDULING_POLICIES}")
        if self.max_model_len is not None:
            _int("max_model_len", self.max_model_len, 1)
        SpeculativeConfig.from_dict(self.speculative_config)   # raises for a bad one, naming the key

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def uses_mtp(self) -> bool:
        """Speculative decoding by the checkpoint's multi-token-prediction layers: every rank loads them."""
        return self.speculative_config is not None and self.speculative_config.get("method") == "mtp"


@dataclass(slots=True)
class EngineConfig:
    model: str = option(help="local HF checkpoint directory", flag_default=SHIPPED_MODEL,
                        flag_default_text="the shipped Shakespeare MoE, models/shakespeare-moe")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = option("auto", "weights and activations (auto: float32 on CPU, bfloat16 on CUDA)",
                        choices=DTYPES)
    device: str = option("auto", "auto: cuda when available, else cpu", choices=DEVICES)
    kernel_backend: str = option("auto", "attention and MoE kernels: Triton on CUDA; on the CPU a C paged "
                                         "decode that reads the cache in place (cpu, built on first use; "
                                         "sdpa where no C compiler runs) (auto); or sdpa (torch's fused "
                                         "attention over gathered blocks), or the torch references",
                                 choices=KERNEL_BACKENDS)
    enforce_eager: bool = option(False, "CUDA: launch every decode step op by op instead of replaying decode "
                                        "graphs (captured per micro-batch bucket on first use; "
                                        "attention_nodes/graphs.py)")
    threads_per_rank: int | None = option(None, "CPU threads per rank (default: the machine's cores / the ranks "
                                                "of the job; set it in a container whose CPU limit is below the "
                                                "node's cores)")
    decode_threads: int | None = option(None, "threads of each attention rank's C paged decode (kernel backend "
                                              "cpu), taken from cores the expert ranks leave idle while they wait "
                                              "(default: the cores this process may run on / the attention "
                                              "ranks, at most 16)")
    generation_config: str = option("auto", "the sampling defaults (temperature, top_p, top_k, min_p, "
                                            "repetition_penalty) of requests that leave them out: auto (the "
                                            "checkpoint's generation_config.json, as vLLM's), vllm (none: the "
                                            "engine's own), or a directory holding a generation_config.json, "
                                            "whose EOS ids then end outputs in place of the checkpoint's")
    chat_template: str | None = option(None, "a Jinja chat template, or the path of a file holding one, rendering "
                                             "chats in place of the checkpoint's (vLLM's --chat-template)")
    collective_timeout_s: float = option(600.0, "a collective that waits longer fails the job")
    heartbeat_s: float = option(1.0, "an idle leader broadcasts at least this often (must be below the "
                                     "collective timeout)")
    rank_failure_s: float = option(3.0, "a rank whose heartbeat thread is silent this long counts as dead")
    startup_timeout_s: float = option(300.0, "how long ranks may take to start and load their weights, pools "
                                             "to register, and a scale request to finish")
    load_progress: bool = option(True, "a progress bar of weight bytes read, on the first rank of each role")
    sync_audit: bool = option(False, "count the host syncs a CUDA run would make (device reads, data-dependent "
                                      "shapes) per decode step on every rank; comm_stats() reports them per rank "
                                      "as host_syncs (adds Python work to every op: for tests and audits)")
    timing_sync: bool = option(False, "CUDA: synchronize the device before each comm/compute timer reads the "
                                      "clock, so comm_stats times are device times, not launch times (a host "
                                      "sync per timed call; the comm profiling tool turns it on)")
    # Separate pool launches (launch/runtime/membership.py, "Joining"): this process's pool and the store that the
    # pools rendezvous through, which the attention pool's first rank (the leader) serves. None: roles by rank.
    role: str | None = option(None, "separate pool launches: this launch's pool (with pool_addr): attention, "
                                    "expert, or with PD prefill or decode (attention ranks joining that pool); "
                                    "without it, one launch holds both pools (roles by rank)", choices=ROLES)
    pool_addr: str | None = option(None, "HOST:PORT of the job's store, served by the attention pool's rank 0 "
                                         "(the leader); every pool launch, and every rank joining later, points "
                                         "here")
    leader_host: str | None = option(None, "with role attention: only rank 0 on this host leads (default: rank "
                                           "0 of any attention launch, so a second attention launch that joins "
                                           "a running job must name the leader's host)")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: choose auto, float32, bfloat16 or float16")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is invalid: choose auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
        resolve_backend(self.kernel_backend, self.device_type())   # an unknown or unrunnable kernel_backend raises
        for name in ("collective_timeout_s", "heartbeat_s", "startup_timeout_s", "rank_failure_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{name}={v!r} is invalid: pass a positive number of seconds")
        for name in ("threads_per_rank", "decode_threads"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 1)
        for name in ("sync_audit", "timing_sync", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: pass True or False")
        source = self.generation_config
        if not isinstance(source, str) or source not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(source, "generation_config.json")):
            raise ValueError(f"generation_config={source!r} is invalid: pass auto, vllm or a directory holding a "
                             f"generation_config.json")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is invalid: choose attention, prefill, decode or expert")
        if (self.role is None) != (self.pool_addr is None):
            raise ValueError(f"role={self.role!r} and pool_addr={self.pool_addr!r}: separate pool launches need "
                             f"both (--role attention|prefill|decode|expert --pool-addr HOST:PORT), a single launch "
                             f"neither")
        if self.pool_addr is not None:
            self.pool_host_port()
        method = (self.scheduler.speculative_config or {}).get("method")
        if self.parallel.prefill_ranks and method not in (None, "ngram"):
            raise ValueError(f"prefill_ranks={self.parallel.prefill_ranks} with speculative method {method!r}: its "
                             f"draft KV does not move with a request from a prefill rank to a decode rank yet; use "
                             f"method 'ngram' with PD, or prefill_ranks=0")
        if self.heartbeat_s >= self.collective_timeout_s:
            raise ValueError(f"heartbeat_s={self.heartbeat_s} must be below collective_timeout_s="
                             f"{self.collective_timeout_s}: idle ranks would time out between heartbeats")

    @classmethod
    def from_options(cls, model: str, attention_ranks: int, expert_ranks: int, **options) -> EngineConfig:
        """Flat keyword options (as LLM(...) and the CLI take them) -> the config tree."""
        owner = {f.name: group for group, f in option_fields() if f.name != "model"}
        groups: dict[str, dict] = {group: {} for group in GROUPS}
        top = {}
        for k, v in options.items():
            if k not in owner:
                raise ValueError(f"unknown option {k!r}; valid options: {', '.join(sorted(owner))}")
            (groups[owner[k]] if owner[k] else top)[k] = v
        groups["parallel"].update(attention_ranks=attention_ranks, expert_ranks=expert_ranks)
        return cls(model=str(model), **{group: GROUPS[group](**kw) for group, kw in groups.items()}, **top)

    def pool_host_port(self) -> tuple[str, int]:
        """pool_addr "HOST:PORT" -> (host, port); ValueError names a malformed one."""
        host, _, port = (self.pool_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"pool_addr={self.pool_addr!r} is invalid: pass HOST:PORT, the address the attention "
                             f"pool's first rank serves the job's store on (e.g. 10.0.0.5:29400)")
        return host, int(port)

    def leader_settings(self) -> dict:
        """What a joining rank takes from the leader's config, so that every rank of the job agrees: the
        parallel, cache and scheduler settings, dtype, kernels, timeouts and the sync audit. Its model path,
        device, threads and start-up timeout stay its own."""
        return {"parallel": asdict(self.parallel), "cache": asdict(self.cache), "scheduler": asdict(self.scheduler),
                **{k: getattr(self, k) for k in ("dtype", "kernel_backend", "collective_timeout_s", "heartbeat_s",
                                                 "rank_failure_s", "sync_audit", "timing_sync")}}

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


GROUPS = {"parallel": ParallelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}   # EngineConfig's parts


def option_fields() -> list[tuple[str, Field]]:
    """Every engine option in declaration order, as (group, field): group is the EngineConfig field holding it
    ("parallel", "cache", "scheduler"), or "" for EngineConfig's own."""
    out = []
    for f in fields(EngineConfig):
        out += [(f.name, g) for g in fields(GROUPS[f.name])] if f.name in GROUPS else [("", f)]
    return out


def option_default(name: str):
    """The declared default of one option."""
    (f,) = [f for _, f in option_fields() if f.name == name]
    return f.default
