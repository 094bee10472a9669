"""`make demo`: the shipped Shakespeare MoE answers a few prompts on 1 attention rank + 2 expert ranks, then a
throughput line.

The model (models/shakespeare-moe, made by scripts/train_tiny_moe.py) ships with the project: no network, no
training at run time. --model runs another local checkpoint instead.
"""
from __future__ import annotations

import argparse
import time

from attention_nodes.sampling_params import SamplingParams
from launch.cli import add_engine_args, engine_options
from launch.llm import LLM

# Speaker headings as the training texts write them ("Name." on its own line), some with a first line.
PROMPTS = [
    "ROMEO.\n",
    "Juliet.\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    "Hamlet.\nTo be, or not to be,",
    "First Citizen.\nWhat say you to the king?\n\nSecond Citizen.\n",
]


def main(argv=None) -> None:
    p = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--num-requests", type=int, default=64)
    args = p.parse_args(argv)
    expert_ranks = args.expert_ranks or 2
    print(f"model: {args.model}")
    print(f"starting {args.attention_ranks} attention rank(s) + {expert_ranks} expert rank(s) ...")
    t0 = time.perf_counter()
    with LLM(args.model, attention_ranks=args.attention_ranks, expert_ranks=expert_ranks,
             **engine_options(args)) as llm:
        print(f"ready in {time.perf_counter() - t0:.1f} s "
              f"({llm.spec.num_experts} experts, top-{llm.spec.top_k}, {llm.spec.num_layers} layers)")
        # Seeded sampling: the same text on every run, whatever else shares the batch.
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=i)
                  for i in range(len(PROMPTS))]
        for prompt, o in zip(PROMPTS, llm.generate(PROMPTS, params)):
            text = o.text if o.text is not None else str(o.token_ids)
            print(f"\n----- prompt {prompt!r} ({o.finish_reason}, {len(o.token_ids)} tokens)")
            print(prompt + text)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                 seed=100 + i, ignore_eos=True) for i in range(args.num_requests)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        print(f"\n{args.num_requests} requests, {n} output tokens in {dt:.2f} s: {n / dt:.1f} tokens/s")


if __name__ == "__main__":
    main()
