"""allowed_token_ids, bad words, min_tokens, logit_bias and the repetition, frequency and presence penalties,
against cases worked by hand and a plain per-row reference."""
import pytest
import torch

from attention_nodes.logits_process import shape_logits, token_logprobs
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import Sequence

EOS = frozenset({0})


def seq(prompt, output, **params) -> Sequence:
    s = Sequence.from_request("r", prompt, SamplingParams(max_tokens=8, **params), 1)
    s.token_ids += output
    return s


def test_penalties_and_bias_worked_by_hand():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0]])
    # prompt [1, 2], output [4, 4, 2]: seen {1, 2, 4}; output counts: 4 -> 2, 2 -> 1.
    s = seq([1, 2], [4, 4, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
            logit_bias={3: 1.5, 5: -10})
    got = shape_logits(logits, [s], EOS)[0].tolist()
    want = [1.0,                              # untouched
            2.0 / 2,                          # seen, positive: divided; not generated
            -1.0 * 2 - 0.5 * 1 - 0.25,        # seen, negative: multiplied; generated once
            0.5 + 1.5,                        # bias
            3.0 / 2 - 0.5 * 2 - 0.25,         # seen; generated twice
            -2.0 - 10]                        # bias
    assert got == pytest.approx(want)
    assert logits[0, 1] == 2.0                # the raw logits are left alone


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(2, 6)
    early = seq([1], [3], min_tokens=2, stop_token_ids=[5])
    done = seq([1], [3, 3], min_tokens=2, stop_token_ids=[5])
    out = shape_logits(logits, [early, done], EOS)
    assert out[0].tolist() == [float("-inf"), 0, 0, 0, 0, float("-inf")]
    assert out[1].tolist() == [0] * 6
    ignoring = seq([1], [], min_tokens=1, ignore_eos=True)
    assert shape_logits(torch.zeros(1, 6), [ignoring], EOS)[0, 0] == 0   # EOS is not a stop here anyway


def test_allowed_tokens_and_bad_words_worked_by_hand():
    logits = torch.arange(6, dtype=torch.float32).repeat(3, 1)
    inf = float("-inf")
    only = seq([1], [2], allowed_token_ids=[1, 4, 9])                 # 9: outside the vocabulary, skipped
    # words: [3] always; [2, 5] after a 2 (the output ends with 2); [4, 1] not (the output does not end with 4);
    # [1, 0] not: its 1 is the prompt's, which does not count (vLLM's rule)
    bad = seq([1], [2], bad_words_token_ids=[[3], [2, 5], [4, 1], [1, 0]])
    early = seq([2], [], bad_words_token_ids=[[2, 5]])                 # no output yet: only the prompt ends in 2
    out = shape_logits(logits, [only, bad, early], EOS)
    assert out[0].tolist() == [inf, 1, inf, inf, 4, inf]
    assert out[1].tolist() == [0, 1, 2, inf, 4, inf]
    assert out[2].tolist() == [0, 1, 2, 3, 4, 5]


def test_bad_words_never_ban_every_allowed_token():
    """A multi-token bad word bans only at run time, so admission cannot see it empty the allowed set: when it would
    ban every allowed token, the row keeps its allowed tokens (before, it sampled token 0, outside the set)."""
    logits = torch.arange(6, dtype=torch.float32).repeat(2, 1)
    inf = float("-inf")
    words = [[5, 5], [5, 4]]
    cornered = seq([1], [5], allowed_token_ids=[4, 5], bad_words_token_ids=words)    # both allowed tokens banned
    open_row = seq([1], [5], allowed_token_ids=[3, 4, 5], bad_words_token_ids=words)  # 3 is left
    out = shape_logits(logits, [cornered, open_row], EOS)
    assert out[0].tolist() == [inf, inf, inf, inf, 4, 5]
    assert out[1].tolist() == [inf, inf, inf, 3, inf, inf]
    # what is left counts min_tokens' bans (EOS 0 here), and one-token bad words stay banned
    late = seq([1], [5], allowed_token_ids=[0, 3, 5], bad_words_token_ids=[[3], [5, 5]], min_tokens=4)
    assert shape_logits(logits[:1], [late], EOS)[0].tolist() == [inf, inf, inf, inf, inf, 5]


def test_untouched_requests_share_the_tensor():
    logits = torch.randn(2, 5)
    assert shape_logits(logits, [seq([1], []), seq([2], [])], EOS) is logits


def test_token_logprobs_hold_the_token_and_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 0.0]])
    lp = torch.log_softmax(logits, -1)
    got = token_logprobs(logits, [0, 0], [2, 0])
    assert got[0] == pytest.approx({3: lp[0, 3].item(), 2: lp[0, 2].item(), 0: lp[0, 0].item()})
    assert got[1] == pytest.approx({0: lp[1, 0].item()})


@pytest.mark.parametrize("kwargs,name", [
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"7": 1.0}}, "logit_bias"), ({"logit_bias": {7: 101}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"), ({"bad_words_token_ids": [[4], []]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [5]}, "bad_words_token_ids")])
def test_bad_values_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}="):
        SamplingParams(**kwargs)


def per_row_reference(logits: torch.Tensor, seqs: list[Sequence], eos: frozenset[int]) -> torch.Tensor:
    """shape_logits written the plain way: one row at a time, one token at a time, in vLLM's order."""
    out = logits.clone()
    vocab = logits.shape[1]
    for row, s in zip(out, seqs):
        p = s.params
        if p.allowed_token_ids:
            for t in range(vocab):
                if t not in p.allowed_token_ids:
                    row[t] = float("-inf")
        for w in p.bad_words_token_ids or []:
            k = len(w) - 1
            if w[-1] < vocab and s.num_output_tokens >= k and (k == 0 or s.output_token_ids[-k:] == w[:-1]):
                row[w[-1]] = float("-inf")
        if s.num_output_tokens < p.min_tokens:
            for t in [*p.stop_token_ids, *([] if p.ignore_eos else eos)]:
                if t < vocab:
                    row[t] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            if t < vocab:
                row[t] += b
        if p.repetition_penalty != 1.0:
            for t in set(s.token_ids):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(s.output_token_ids):
            n = s.output_token_ids.count(t)
            row[t] -= p.frequency_penalty * n + p.presence_penalty
    return out


def make_mixed_seqs(num_rows: int, vocab: int, seed: int) -> list[Sequence]:
    """Rows with random combinations of the options (every third row with none); prompts and outputs repeat
    tokens, and stop ids and bias keys include ids outside the vocabulary."""
    g = torch.Generator().manual_seed(seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=g))]

    def tokens(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=g).tolist()

    seqs = []
    for i in range(num_rows):
        params = {} if i % 3 == 1 else dict(min_tokens=pick(0, 2, 5), stop_token_ids=pick([], [3, vocab + 4], [7]),
                      ignore_eos=pick(False, True), repetition_penalty=pick(1.0, 1.3, 0.7),
                      frequency_penalty=pick(0.0, 0.6, -1.1), presence_penalty=pick(0.0, 0.4, -2.0),
                      logit_bias=pick(None, {}, {1: 2.5, 9: -100.0, vocab + 1: 3.0}, {0: 7.0}),
                      allowed_token_ids=pick(None, None, tokens(12) + [vocab + 2]))
        output = tokens(pick(0, 3, 9))
        # bad words: one token, and the output's last one or two tokens followed by another (or not)
        params["bad_words_token_ids"] = pick(None, [tokens(1), output[-2:] + tokens(1), tokens(2)]) if i % 3 != 1 \
            and output else None
        seqs.append(seq(tokens(pick(1, 6, 20)), output, **params))
    return seqs


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_rows_equal_the_per_row_reference(seed):
    vocab = 40
    seqs = make_mixed_seqs(12, vocab, seed)
    assert any(s.params.shapes_logits for s in seqs) and not all(s.params.shapes_logits for s in seqs)
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(100 + seed)) * 3
    eos = frozenset({0, 2})
    got = shape_logits(logits, seqs, eos)
    # Within float32 rounding: the reference adds Python floats, the runtime float32 tensors. -inf must match.
    torch.testing.assert_close(got, per_row_reference(logits, seqs, eos), rtol=1e-6, atol=1e-6)
    plain = [i for i, s in enumerate(seqs) if not s.params.shapes_logits]
    assert torch.equal(got[plain], logits[plain])         # rows that ask for nothing are left alone


def test_non_contiguous_logits_are_shaped_like_contiguous_ones():
    seqs = make_mixed_seqs(6, 16, seed=9)
    wide = torch.randn(6, 32)
    got = shape_logits(wide[:, ::2], seqs, EOS)
    assert got.is_contiguous() and torch.equal(got, shape_logits(wide[:, ::2].contiguous(), seqs, EOS))
