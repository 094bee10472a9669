"""attention_nodes/spec_decode.py: prompt lookup against a brute-force search, greedy verification against the
argmax chain worked out in the test, and a seeded chi-square test that verified sampling emits the target's
distribution (and that the same test rejects a broken acceptance rule)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_nodes.spec_decode import ngram_propose, verify
from tests.host_reads import no_host_reads


def _brute_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for i in range(len(tokens) - n - 1, -1, -1):     # latest earlier occurrence first
            if tokens[i:i + n] == tokens[-n:]:
                return tokens[i + n:i + n + k]
    return []


def test_prompt_lookup_equals_a_brute_force_search():
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(400):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        k, min_n = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        got = ngram_propose(np.array(tokens), k, min_n, max_n).tolist()
        assert got == _brute_ngram(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        found += bool(got)
    assert 100 < found < 400      # both outcomes were exercised
    # vLLM's documented case: [4, 2] follow the earlier [2, 3] (vLLM stops at max_model_len; k stops here)
    assert ngram_propose(np.array([1, 2, 3, 4, 2, 3]), 2, 2, 3).tolist() == [4, 2]
    with pytest.raises(ValueError, match="min_n=0"):
        ngram_propose(np.array([1, 2]), 2, 0, 1)


def test_greedy_verification_emits_the_tokens_without_speculation():
    """One-hot targets at each position's argmax: the accepted drafts are the longest prefix equal to the argmax
    chain, then the argmax at the first mismatch (or the bonus position): what greedy decoding emits."""
    g = torch.Generator().manual_seed(1)
    B, k, V = 64, 4, 7
    logits = torch.randn(B, k + 1, V, generator=g)
    best = logits.argmax(-1)
    target = torch.nn.functional.one_hot(best, V).float()
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.7, best[:, :k], torch.randint(0, V, (B, k), generator=g))
    num = torch.randint(0, k + 1, (B,), generator=g)
    uniform, exponential = torch.rand(B, k, generator=g), torch.empty(B, V).exponential_(generator=g)
    with no_host_reads():     # on the decode path: nothing waits on the device
        tokens, emitted = verify(target, drafts, num, None, uniform, exponential)
    for b in range(B):
        want = []
        for i in range(int(num[b]) + 1):
            want.append(int(best[b, i]))
            if i == num[b] or drafts[b, i] != best[b, i]:
                break
        assert int(emitted[b]) == len(want)
        assert tokens[b].tolist() == want + [-1] * (k + 1 - len(want)), b


def _first_two(target: torch.Tensor, drafts: torch.Tensor, draft_probs, g: torch.Generator) -> torch.Tensor:
    """Verify one step of n requests, each with the same context-free targets `[k + 1, V]`, and return each one's
    first two emitted tokens; a request that emitted one token draws its second from position 1's target (the
    next step, in which it is the first)."""
    n, k = drafts.shape
    V = target.shape[-1]
    tokens, emitted = verify(target.expand(n, k + 1, V), drafts, torch.full((n,), k), draft_probs,
                             torch.rand(n, k, generator=g), torch.empty(n, V).exponential_(generator=g))
    second = torch.multinomial(target[1], n, replacement=True, generator=g)
    return torch.stack([tokens[:, 0], torch.where(emitted > 1, tokens[:, 1], second)], dim=1)


def _p_value(pairs: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit of the observed pairs to the expected joint `[V, V]` probabilities."""
    V = expected.shape[0]
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    exp = expected.flatten().double() * len(pairs)
    stat = ((counts - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((V * V - 1) / 2.0), stat / 2))


@pytest.mark.parametrize("draft", ["draft_model", "prompt_lookup"])
def test_sampled_tokens_follow_the_target_distribution(draft):
    """8000 seeded requests, vocabulary 4, 2 drafts each, targets that differ by position. Drafts from a draft
    model's q (far from the target), or deterministic (prompt lookup: the same two tokens every time). The first
    two emitted tokens must fit target_0 x target_1 (chi-square, 15 degrees of freedom, p > 1e-3). Verified with
    the draft model's probabilities of the wrong position (an off-by-one: each draft judged by the other slot's
    q), the same test must reject them (p < 1e-9). (Judging sampled drafts as if they were deterministic, q
    one-hot, is not such a bug: it is exact for any draft token, only accepting less.)"""
    g = torch.Generator().manual_seed(7)
    V, k, n = 4, 2, 8000
    target = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    expected = target[0].unsqueeze(1) * target[1].unsqueeze(0)
    if draft == "prompt_lookup":
        drafts, q = torch.tensor([[2, 0]]).expand(n, k).contiguous(), None
    else:
        q = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.8]]).expand(n, k, V)
        drafts = torch.stack([torch.multinomial(q[0, i], n, replacement=True, generator=g) for i in range(k)], 1)
    assert _p_value(_first_two(target, drafts, q, g), expected) > 1e-3
    if q is not None:   # the test has the power to see a wrong acceptance rule
        assert _p_value(_first_two(target, drafts, q.flip(1), g), expected) < 1e-9
