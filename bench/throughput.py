"""Offline throughput: this runtime (1 attention + 2 expert ranks by default, continuous batching) against HF
`generate` in static batches of 64 (left-padded), on the same workload, in the same run.

Model: the shipped Shakespeare MoE (models/shakespeare-moe: Qwen3-MoE, 5 layers, hidden 256, 8 experts, top-2),
or --model. Workload: 256 requests whose prompts are 16-256-token passages of the held-out play (random token
ids for a checkpoint without heldout.txt); outputs 8-256 tokens, long-tailed; at most 64 in flight. Only the
tokens each request asked for count as output. Prints the median over --repeats runs after a warm-up, the
spread, and the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from launch import LLM, SamplingParams
from models import SHIPPED_MODEL


def workload(n: int, seed: int = 0, max_output: int = 256, model: str = SHIPPED_MODEL
             ) -> tuple[list[list[int]], list[int]]:
    """n token-id prompts of 16-256 tokens and output lengths of 8-max_output."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(16, 257, (n,), generator=g)
    # Long tail: most outputs short, a few near max_output (u^3 puts ~half of the mass below 40 of 256).
    olens = (8 + (max_output - 8) * torch.rand(n, generator=g) ** 3).round().long()
    text = os.path.join(model, "heldout.txt")
    if os.path.exists(text):
        from transformers import AutoTokenizer
        with open(text) as f:
            ids = AutoTokenizer.from_pretrained(model)(f.read(), add_special_tokens=False)["input_ids"]
        starts = torch.randint(0, len(ids) - 256, (n,), generator=g).tolist()
        prompts = [ids[s:s + int(L)] for s, L in zip(starts, plens)]
    else:
        prompts = [torch.randint(3, 300, (int(L),), generator=g).tolist() for L in plens]
    return prompts, olens.tolist()


def synthetic_checkpoint(path: str, layers: int, device: str) -> str:
    """A random checkpoint of Qwen3-30B-A3B's shape (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
    of 768, top-8, vocab 151936) with `layers` layers, bf16, initialised on `device` -> path."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                         num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                         norm_topk_prob=True, tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def run_ours(llm: LLM, prompts, olens) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in olens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    assert n == sum(olens), (n, sum(olens))
    return dt, n


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A static batch as HF `generate` takes it: ids and attention mask `[n, longest]`, left-padded with 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    return ids, mask


def run_hf(model, prompts, olens, batch: int = 64) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ps, os_ = prompts[i:i + batch], olens[i:i + batch]
            ids, mask = left_padded(ps)
            ids, mask = ids.to(model.device), mask.to(model.device)
            model.generate(ids, attention_mask=mask, max_new_tokens=max(os_), do_sample=False, pad_token_id=0)
            n += sum(os_)  # useful tokens only: the padded batch runs to its longest request
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=0, help="micro_batches (default 0: the engine's auto)")
    ap.add_argument("--model", default=SHIPPED_MODEL, help="HF checkpoint directory (default: the shipped model)")
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="both engines' device")
    ap.add_argument("--dtype", default=None, help="both engines' dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--synthetic-layers", type=int, default=0,
                    help="instead of --model: a random Qwen3-30B-A3B-shaped checkpoint with this many layers")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache per attention rank")
    ap.add_argument("--kv-cache-dtype", default="auto", help="what the KV cache stores (the engine's kv_cache_dtype: "
                                                             "auto, fp8, fp8_e4m3 or fp8_e5m2)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="CUDA: share of the GPU the engine's ranks may use (HF's model counts in what they find used)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="CUDA: no decode graphs (the engine's enforce_eager option)")
    ap.add_argument("--cuda-ipc-events", action="store_true",
                    help="cuda_ipc: signal messages with CUDA IPC events (the engine's cuda_ipc_events option)")
    ap.add_argument("--smoke", action="store_true", help="16 requests of at most 32 output tokens, one run: " +
                    "a quick run that checks the bench works (tests run it; its figures mean little)")
    args = ap.parse_args()
    max_output = 256
    if args.smoke:
        args.requests, args.repeats, max_output = 16, 1, 32
    from transformers import AutoModelForCausalLM

    if args.synthetic_layers:
        import tempfile
        args.model = synthetic_checkpoint(tempfile.mkdtemp(prefix="qwen3-30b-shape-"), args.synthetic_layers,
                                          args.device)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    prompts, olens = workload(args.requests, max_output=max_output, model=args.model)
    print(f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, "
          f"output tokens {sum(olens)} (min {min(olens)}, median {int(statistics.median(olens))}, max {max(olens)})")
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype)).to(args.device).eval()
    hf.generation_config.eos_token_id = None
    A, E = args.attention_ranks, args.expert_ranks
    # 64 requests in flight in all, as in HF's batches: max_num_seqs is per attention rank.
    with LLM(args.model, attention_ranks=A, expert_ranks=E, max_num_seqs=64 // A, max_num_batched_tokens=512,
             threads_per_rank=args.threads_per_rank, micro_batches=args.micro_batches, device=args.device,
             dtype=dtype, kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
             gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
             cuda_ipc_events=args.cuda_ipc_events) as llm:
        run_ours(llm, prompts[:16], olens[:16])        # warm-up
        run_hf(hf, prompts[:16], [8] * 16, batch=16)    # warm-up
        ours, base = [], []
        for _ in range(args.repeats):
            dt, n = run_ours(llm, prompts, olens)
            ours.append(n / dt)
            dt, n = run_hf(hf, prompts, olens)
            base.append(n / dt)
        stats = llm.stats()
        kv_blocks = stats["kv_blocks"]
        graphs = [r.get("graphs") for r in llm.comm_stats()["ranks"].values() if r.get("graphs") is not None]
    mo, mb = statistics.median(ours), statistics.median(base)
    print(f"device {args.device}, dtype {dtype}, KV cache {args.kv_cache_dtype}, model {args.model}, KV blocks per "
          f"attention rank {kv_blocks}, "
          f"micro-batches {stats['micro_batches']} (--micro-batches {args.micro_batches})")
    print("decode graphs: " + ("; ".join(f"{len(g['captured'])} captured, {g['replays']} replays, {g['eager']} too "
                                         f"big, failed {g['failed']}" for g in graphs) or "off"))
    print(f"afserve {A}+{E} ranks      : {mo:8.1f} output tok/s (runs: {', '.join(f'{x:.1f}' for x in ours)})")
    print(f"HF generate, batch 64  : {mb:8.1f} output tok/s (runs: {', '.join(f'{x:.1f}' for x in base)})")
    print(f"ratio                  : {mo / mb:.2f}x")


if __name__ == "__main__":
    main()
