"""Command-line options shared by serve.py and demo.py, mapped onto LLM(...) keyword options."""
from __future__ import annotations

import argparse

from kernels.ops import BACKENDS as KERNEL_BACKENDS
from models import SHIPPED_MODEL

from .config import BALANCERS, COMM_MODES, TRANSPORTS


def add_engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=SHIPPED_MODEL,
                   help="HF checkpoint directory (local; default: the shipped Shakespeare MoE, models/shakespeare-moe)")
    p.add_argument("--attention-ranks", type=int, default=1)
    p.add_argument("--expert-ranks", type=int, default=None,
                   help="default: world size - attention ranks under torchrun, 2 otherwise")
    p.add_argument("--comm", choices=COMM_MODES, default="direct")
    p.add_argument("--balancer", choices=BALANCERS, default="static")
    p.add_argument("--redundant-experts", type=int, default=0, help="extra expert slots for replicas")
    p.add_argument("--rebalance-interval", type=int, default=0,
                   help="recompute the expert placement every N steps (0: never)")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--comm-calibration", default=None,
                   help="comm=auto: alpha-beta calibration JSON to load (or to write after measuring)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="CPU data plane: shared memory on one host, gloo collectives, or auto")
    p.add_argument("--micro-batches", type=int, default=1, help="ping-pong micro-batches per step")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache per attention rank")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off prefix caching (on by default: cached full blocks of earlier prompts are reused)")
    p.add_argument("--kv-offload-memory", type=int, default=0,
                   help="bytes of host memory per attention rank for KV blocks evicted from the prefix cache "
                        "(0: off)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--kernel-backend", choices=KERNEL_BACKENDS, default="auto",
                   help="attention and MoE kernels: Triton on CUDA and torch references on CPU (auto), or either")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="CPU threads per rank (default: the machine's cores / the ranks of the job; set it in a "
                        "container whose CPU limit is below the node's cores)")
    p.add_argument("--collective-timeout-s", type=float, default=600.0,
                   help="a collective that waits longer fails the job")
    p.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="an idle leader broadcasts at least this often (must be below the collective timeout)")
    return p


def engine_options(args: argparse.Namespace) -> dict:
    """The LLM(...) options named by the parsed arguments."""
    keys = ("comm", "comm_calibration", "balancer", "redundant_experts", "rebalance_interval", "ranks_per_node",
            "transport", "micro_batches", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "kv_cache_memory", "block_size", "enable_prefix_caching", "kv_offload_memory",
            "dtype", "device", "kernel_backend", "threads_per_rank", "collective_timeout_s",
            "heartbeat_s")
    return {k: getattr(args, k) for k in keys}
