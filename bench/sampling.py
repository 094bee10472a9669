"""The batched sampler and logits shaping against the per-row loops they replaced, measured in the same run.

Sampler: 64 rows at vocabulary 2048 and 32768, in four mixes: all greedy; all random (temperature 1, no
filters, unseeded); mixed (a third greedy, a third seeded, a third unseeded); mixed with top-k 50 / top-p 0.9 on
the random rows. "per-row" is the sampler as it was (written out below): greedy for every row and a host read,
then the random rows' temperature and filters batched and one torch.multinomial(...).item() per random row;
"batched" is Sampler.sample (the exponential race, one host read). Also q's draw alone: Tensor.exponential_
against fill_exponential (-log(U)) on `[64, V]`.
shape_logits: 64 rows each with repetition, frequency and presence penalties and a 4-token logit_bias, prompt 512
and output 128 tokens, against the per-row loop it replaced (written out below).
Times: median of --repeats calls after --warmup, with the 20th-80th percentile; ratio = per-row / batched.
Run: python bench/sampling.py [--repeats 20] [--warmup 3] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from attention_nodes.logits_process import shape_logits
from attention_nodes.sampler import Sampler, apply_top_k_top_p, fill_exponential
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import Sequence

NUM_ROWS = 64
VOCABS = (2048, 32768)
EOS = frozenset({0})


def per_row_sample(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[int]:
    """The sampler before the batched pass: one multinomial and one host read per random row."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rand_rows:
        return tokens
    rows = torch.tensor(rand_rows)
    temp = torch.tensor([params[i].temperature for i in rand_rows])
    top_k = torch.tensor([params[i].top_k for i in rand_rows], dtype=torch.int64)
    top_p = torch.tensor([params[i].top_p for i in rand_rows], dtype=torch.float32)
    probs = apply_top_k_top_p(logits.index_select(0, rows) / temp.unsqueeze(1), top_k, top_p).softmax(dim=-1)
    for j, i in enumerate(rand_rows):
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return tokens


def per_row_shape(logits: torch.Tensor, seqs: list[Sequence], eos: frozenset[int]) -> torch.Tensor:
    """shape_logits before vectorising: each step per row."""
    logits = logits.clone()
    vocab = logits.shape[1]
    for seq, row in zip(seqs, logits):
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            row[[t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos)) if t < vocab]] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids])
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64),
                                    minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def timed(fn, warmup: int, repeats: int) -> tuple[float, float, float]:
    """fn's (median, p20, p80) in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[len(times) // 5], times[(4 * len(times)) // 5]


def sampler_mix(name: str) -> tuple[list[SamplingParams], list[bool]]:
    """NUM_ROWS params and which rows are seeded."""
    if name == "all greedy":
        return [SamplingParams()] * NUM_ROWS, [False] * NUM_ROWS
    if name == "all random":
        return [SamplingParams(temperature=1.0)] * NUM_ROWS, [False] * NUM_ROWS
    filters = {"top_k": 50, "top_p": 0.9} if name.endswith("top-p") else {}
    params = [SamplingParams() if i % 3 == 0 else SamplingParams(temperature=0.8, seed=i, **filters)
              if i % 3 == 1 else SamplingParams(temperature=0.8, **filters) for i in range(NUM_ROWS)]
    return params, [i % 3 == 1 for i in range(NUM_ROWS)]


def sample_call(fn, logits: torch.Tensor, params: list[SamplingParams], seeded: list[bool]):
    """fn(logits, params, generators) with fresh generators on the seeded rows each call, as new requests would
    have (both sides pay for making them)."""
    def call():
        return fn(logits, params, [torch.Generator().manual_seed(i) if s else None for i, s in enumerate(seeded)])
    return call


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def fmt(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.2f} ({t[1]:.2f}-{t[2]:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; {NUM_ROWS} rows; ms: median "
          f"(p20-p80) of {args.repeats} after {args.warmup} warm-up")
    print()
    print(row(["sampler mix", "V", "per-row", "batched", "ratio"]))
    print(row(["---"] * 5))
    sampler = Sampler()
    for vocab in VOCABS:
        logits = torch.randn(NUM_ROWS, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
        for name in ("all greedy", "all random", "mixed seeded", "mixed seeded, top-k/top-p"):
            params, seeded = sampler_mix(name)
            old = timed(sample_call(per_row_sample, logits, params, seeded), args.warmup, args.repeats)
            new = timed(sample_call(sampler.sample, logits, params, seeded), args.warmup, args.repeats)
            print(row([name, str(vocab), fmt(old), fmt(new), f"{old[0] / new[0]:.2f}x"]))
    print()
    print(row(["q ~ Exp(1), [64, V]", "V", "exponential_", "-log(U)", "ratio"]))
    print(row(["---"] * 5))
    for vocab in VOCABS:
        q = torch.empty(NUM_ROWS, vocab)
        old = timed(q.exponential_, args.warmup, args.repeats)
        new = timed(partial(fill_exponential, q), args.warmup, args.repeats)
        print(row(["one batched draw", str(vocab), fmt(old), fmt(new), f"{old[0] / new[0]:.2f}x"]))
    print()
    print(row(["shape_logits", "V", "per-row", "batched", "ratio"]))
    print(row(["---"] * 5))
    for vocab in VOCABS:
        g = torch.Generator().manual_seed(1)
        params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                                logit_bias={1: 5.0, 2: -5.0, 3: 1.0, 4: -100.0})
        seqs = []
        for i in range(NUM_ROWS):
            s = Sequence.from_request(f"r{i}", torch.randint(vocab, (512,), generator=g).tolist(), params, i)
            s.token_ids += torch.randint(vocab, (128,), generator=g).tolist()
            seqs.append(s)
        logits = torch.randn(NUM_ROWS, vocab, generator=g)
        assert torch.equal(per_row_shape(logits, seqs, EOS), shape_logits(logits, seqs, EOS))
        old = timed(partial(per_row_shape, logits, seqs, EOS), args.warmup, args.repeats)
        new = timed(partial(shape_logits, logits, seqs, EOS), args.warmup, args.repeats)
        print(row(["penalties + bias, prompt 512, output 128", str(vocab), fmt(old), fmt(new),
                   f"{old[0] / new[0]:.2f}x"]))


if __name__ == "__main__":
    main()
