"""Sampler: greedy matches argmax, filters keep the right tokens, seeds are batch-independent."""
import math

import pytest
import torch

from attention_nodes.sampler import Sampler, apply_top_k_top_p
from attention_nodes.sampling_params import SamplingParams


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=make_gen(seed)) * 2.0


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


def test_greedy_is_argmax_with_first_max_on_ties():
    logits = make_logits(6, 50)
    logits[2, 7] = logits[2, 31] = logits[2].max() + 1.0  # tie: first index must win
    logits = logits.to(torch.bfloat16)
    params = [SamplingParams()] * 6
    tokens = Sampler().sample(logits, params, [None] * 6)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert tokens[2] == 7
    assert all(type(t) is int for t in tokens)


def test_top_k_one_with_temperature_equals_greedy():
    logits = make_logits(8, 100, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    gens = [make_gen(i) for i in range(8)]
    assert Sampler().sample(logits, params, gens) == logits.argmax(dim=-1).tolist()


def test_top_k_never_leaves_the_k_largest():
    logits = make_logits(1, 40, seed=2)
    allowed = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=5)] * 500
    seen = Sampler().sample(logits.expand(500, 40), params, [make_gen(3)] * 500)
    assert set(seen) <= allowed
    assert len(set(seen)) == 5  # high temperature: all five get drawn


def test_apply_top_k_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0, 9]), torch.ones(3))
    assert kept(out) == [[1, 2], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert torch.equal(out[0, [1, 2]], logits[0, [1, 2]])  # kept logits unchanged


@pytest.mark.parametrize("top_p, want", [(0.8, [0, 1]), (0.81, [0, 1, 2]), (0.5, [0]), (0.3, [0]),
                                         (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3]), (1e-9, [0])])
def test_top_p_keeps_exactly_the_nucleus(top_p, want):
    probs = [0.15, 0.5, 0.05, 0.3]  # shuffled so the sort is exercised
    logits = torch.tensor([[math.log(p) for p in probs]])
    out = apply_top_k_top_p(logits, torch.zeros(1, dtype=torch.int64), torch.tensor([top_p]))
    by_prob = [1, 3, 0, 2]  # token ids from most to least likely
    assert kept(out)[0] == sorted(by_prob[: len(want)])


def test_top_p_applies_after_top_k_and_rows_are_independent():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3))
    out = apply_top_k_top_p(logits, torch.tensor([2, 0, 3]), torch.tensor([0.9, 0.9, 0.5]))
    # Row 0: top-2 renormalises to [4/7, 3/7]; 4/7 < 0.9 so both stay.
    # Row 1: 0.4 + 0.3 + 0.2 = 0.9 reaches p, so three stay. Row 2: 0.4/0.9 < 0.5 < 0.7/0.9.
    assert kept(out) == [[0, 1], [0, 1, 2], [0, 1]]


def test_same_seed_same_tokens_whatever_the_batch():
    vocab, steps = 64, 20
    target = make_logits(1, vocab, seed=5)
    sampler = Sampler()
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=30, seed=7)

    def run(position: int, num_rows: int) -> list[int]:
        others = make_logits(num_rows, vocab, seed=100 + num_rows)
        others[position] = target[0]
        params = [SamplingParams(temperature=0.7, seed=i) for i in range(num_rows)]
        params[position] = p
        gens = [make_gen(1000 + i) for i in range(num_rows)]
        gens[position] = make_gen(p.seed)
        return [sampler.sample(others, params, gens)[position] for _ in range(steps)]

    alone = run(0, 1)
    assert run(2, 5) == alone
    assert run(0, 3) == alone
    assert run(6, 7) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(2, 32)  # uniform: any difference comes from the generators
    params = [SamplingParams(temperature=1.0)] * 2
    gens = [make_gen(1), make_gen(2)]
    draws = [Sampler().sample(logits, params, gens) for _ in range(50)]
    seq_a, seq_b = [d[0] for d in draws], [d[1] for d in draws]
    assert seq_a != seq_b
    assert sum(a == b for a, b in zip(seq_a, seq_b)) < 10


def test_mixed_greedy_and_random_batch():
    logits = make_logits(4, 30, seed=8)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(), SamplingParams(temperature=0.9, top_k=1)]
    tokens = Sampler().sample(logits, params, [None, make_gen(3), None, make_gen(4)])
    greedy = logits.argmax(dim=-1).tolist()
    assert tokens[0] == greedy[0] and tokens[2] == greedy[2] and tokens[3] == greedy[3]
    alone = Sampler().sample(logits[1:2], params[1:2], [make_gen(3)])
    assert tokens[1] == alone[0]


def test_temperature_one_matches_softmax():
    num_draws, vocab = 20_000, 8
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0]])
    gen = make_gen(11)
    params = [SamplingParams(temperature=1.0)] * num_draws
    tokens = Sampler().sample(logits.expand(num_draws, vocab), params, [gen] * num_draws)
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).float() / num_draws
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.03


def test_temperature_sharpens_distribution():
    num_draws, vocab = 5_000, 4
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]]).expand(num_draws, vocab)
    cold = Sampler().sample(logits, [SamplingParams(temperature=0.25)] * num_draws, [make_gen(0)] * num_draws)
    hot = Sampler().sample(logits, [SamplingParams(temperature=4.0)] * num_draws, [make_gen(0)] * num_draws)
    assert cold.count(0) / num_draws > 0.8  # softmax([4, 2, 0, -2])[0] ~ 0.87
    assert hot.count(0) / num_draws < 0.4  # softmax([.25, .125, 0, -.125])[0] ~ 0.29


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="one of each per row"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler().sample(torch.zeros(4), [SamplingParams()], [None])
