"""Sampler: greedy matches argmax, filters keep the right tokens, seeds are batch-independent."""
import math

import pytest
import torch

from attention_nodes.sampler import Sampler, SamplingColumns, apply_top_k_top_p, argmax_rows
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


def test_min_p_one_with_temperature_equals_greedy():
    logits = make_logits(8, 100, seed=2)
    params = [SamplingParams(temperature=1.5, min_p=1.0)] * 8
    assert Sampler().sample(logits, params, [make_gen(i) for i in range(8)]) == logits.argmax(dim=-1).tolist()


def test_min_p_keeps_what_transformers_keeps():
    """The distribution drawn from equals transformers' temperature then min-p warpers' softmax."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper
    logits = make_logits(6, 50, seed=5)
    for min_p in (0.05, 0.3, 0.9):
        params = [SamplingParams(temperature=0.7, min_p=min_p)] * 5 + [SamplingParams()]   # and a greedy row
        probs = Sampler.target_probs(logits, params, SamplingColumns.of(params, logits.device))
        want = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(0.7)(None, logits[:5].clone())).softmax(-1)
        torch.testing.assert_close(probs[:5], want)
        assert 0 < int((probs[:5] == 0).sum()) < probs[:5].numel()


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


def test_seeded_rows_ignore_batch_mates_and_order():
    """A seeded row among unseeded, greedy, filtered and other seeded rows, in any order, draws what it draws alone
    (over several steps, so the generator's position after each step must match too)."""
    vocab, steps = 96, 12
    target = make_logits(1, vocab, seed=20)
    mine = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5)
    others = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=1.3, seed=9),
              SamplingParams(temperature=0.6, top_p=0.5), SamplingParams(temperature=2.0, top_k=3, seed=1),
              SamplingParams(seed=4)]   # greedy with a seed: its generator is not drawn from

    def run(order: list[int]) -> list[int]:
        """order: a permutation of range(7); index 6 is the target row."""
        rows = make_logits(7, vocab, seed=21)
        rows[6] = target[0]
        params, gens = others + [mine], [None if p.seed is None else make_gen(p.seed) for p in others + [mine]]
        tokens = []
        for _ in range(steps):
            drawn = Sampler().sample(rows[order], [params[i] for i in order], [gens[i] for i in order])
            tokens.append(drawn[order.index(6)])
        assert torch.equal(gens[5].get_state(), make_gen(4).get_state())   # the greedy row drew nothing
        return tokens

    alone = [Sampler().sample(target, [mine], [gen])[0] for gen in [make_gen(5)] for _ in range(steps)]
    assert len(set(alone)) > 1   # it really sampled
    for order in ([6, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6], [3, 6, 5, 0, 4, 2, 1], [5, 4, 3, 2, 1, 0, 6]):
        assert run(order) == alone, order


def test_draw_returns_one_int64_tensor_per_row():
    logits = make_logits(5, 20, seed=30)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=2), SamplingParams(temperature=1.0),
              SamplingParams(), SamplingParams(temperature=0.5, top_k=4)]
    gens = [None, make_gen(2), None, None, None]
    ids = Sampler().draw(logits, params, gens)
    assert ids.shape == (5,) and ids.dtype == torch.int64 and ids.device == logits.device
    assert ((ids >= 0) & (ids < 20)).all()
    assert ids[0] == logits[0].argmax() and ids[3] == logits[3].argmax()
    assert Sampler().draw(logits, [SamplingParams()] * 5, [None] * 5).tolist() == logits.argmax(-1).tolist()


# probs [0.1, 0.4, 0.2, 0.3]; each case's expected distribution worked by hand (not through apply_top_k_top_p).
FOUR = [0.1, 0.4, 0.2, 0.3]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("kwargs, want", [
    ({"temperature": 1.0}, FOUR),
    ({"temperature": 1.0, "top_k": 2}, [0, 0.4 / 0.7, 0, 0.3 / 0.7]),
    ({"temperature": 1.0, "top_p": 0.6}, [0, 0.4 / 0.7, 0, 0.3 / 0.7]),       # mass before 0.2 is 0.7 >= 0.6
    ({"temperature": 1.0, "top_p": 0.75}, [0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9]),
    ({"temperature": 1.0, "top_k": 3, "top_p": 0.5}, [0, 0.4 / 0.7, 0, 0.3 / 0.7]),   # top-3 renormalised: 4/9 < .5
    ({"temperature": 0.5}, [p * p / 0.3 for p in FOUR]),                     # softmax(2 log p) = p^2 / sum p^2
    ({"temperature": 1.0, "min_p": 0.7}, [0, 0.4 / 0.7, 0, 0.3 / 0.7]),      # below 0.7 * 0.4 = 0.28 goes
    # min_p before top_p (vLLM's order): 0.1 goes (< 0.18), then 0.2 / 0.9 has 0.7 / 0.9 >= 0.75 before it and goes
    # too (top_p first would keep 0.2, whose mass before is 0.7 < 0.75, and min_p would then keep it)
    ({"temperature": 1.0, "min_p": 0.45, "top_p": 0.75}, [0, 0.4 / 0.7, 0, 0.3 / 0.7]),
])
def test_sampled_frequencies_match_the_distribution(kwargs, want, seeded):
    """20k rows of one batch: every token's frequency is within 0.015 (over 4 standard deviations) of the
    distribution the filters leave, for the batched draw and for per-row generators."""
    num_draws = 20_000
    torch.manual_seed(1234)
    logits = torch.log(torch.tensor([FOUR])).expand(num_draws, 4)
    params = [SamplingParams(**kwargs)] * num_draws
    gens = [make_gen(i) for i in range(num_draws)] if seeded else [None] * num_draws
    tokens = Sampler().sample(logits, params, gens)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / num_draws
    assert sum(want) == pytest.approx(1.0)
    assert (freq - torch.tensor(want, dtype=torch.float64)).abs().max() < 0.015, freq.tolist()
    assert all(freq[t] == 0 for t in range(4) if want[t] == 0)     # filtered tokens are never drawn


@pytest.mark.parametrize("shape", [(64, 2048), (3, 7), (1, 1), (0, 5)])
def test_argmax_rows_matches_torch_argmax_with_ties_infinities_and_nan(shape):
    x = make_logits(*shape, seed=41)
    if shape[0] >= 3 and shape[1] >= 7:
        x[0, 2] = x[0, 5] = x[0].max() + 1.0          # tie: the first index wins
        x[1] = float("-inf")                           # a fully masked row: index 0
        x[2, 3], x[2, 6] = float("nan"), float("inf")  # NaN counts as the maximum
    want = x.argmax(dim=-1)
    for t in (x, x.t().contiguous().t(), x.to(torch.bfloat16)):   # numpy path, then non-contiguous and bf16
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and got.shape == (shape[0],)
        assert got.tolist() == t.argmax(dim=-1).tolist()
    assert argmax_rows(x).tolist() == want.tolist()
