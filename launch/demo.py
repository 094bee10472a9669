"""`make demo`: generate from a small MoE checkpoint on 1 attention rank + 2 expert ranks.

With no --model it builds a small random Qwen3-MoE checkpoint (and tokenizer) locally, no network.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from attention_nodes.sampling_params import SamplingParams
from launch.cli import add_engine_args, engine_options
from launch.llm import LLM
from models.tiny import make_tiny_checkpoint

PROMPTS = [
    "Mixture-of-experts models route each token",
    "Attention ranks hold the paged KV cache;",
    "The quick brown fox",
    "Every layer dispatches tokens to the experts and",
]


def main(argv=None) -> None:
    p = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-requests", type=int, default=64)
    args = p.parse_args(argv)
    expert_ranks = args.expert_ranks or 2
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = make_tiny_checkpoint("qwen3_moe", tmp, hidden_size=128, num_hidden_layers=4, num_experts=16,
                                        num_experts_per_tok=4, moe_intermediate_size=64)
            print(f"built a random Qwen3-MoE checkpoint in {path} (4 layers, 16 experts, top-4)")
        print(f"starting {args.attention_ranks} attention rank(s) + {expert_ranks} expert rank(s) ...")
        t0 = time.perf_counter()
        with LLM(path, attention_ranks=args.attention_ranks, expert_ranks=expert_ranks,
                 **engine_options(args)) as llm:
            print(f"ready in {time.perf_counter() - t0:.1f} s")
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            for o in llm.generate(PROMPTS, params):
                print(f"\n> {llm.tokenizer.decode(o.prompt_token_ids) if llm.tokenizer else o.prompt_token_ids}")
                print(f"  tokens: {o.token_ids[:16]}{' ...' if len(o.token_ids) > 16 else ''}")
                print(f"  text:   {o.text!r}  ({o.finish_reason})")
            prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(args.num_requests)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            n = sum(len(o.token_ids) for o in outs)
            print(f"\n{args.num_requests} requests, {n} output tokens in {dt:.2f} s: {n / dt:.1f} tokens/s")


if __name__ == "__main__":
    main()
