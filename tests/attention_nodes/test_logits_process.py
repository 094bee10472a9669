"""min_tokens, logit_bias and the repetition, frequency and presence penalties, against cases worked by hand."""
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
    ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens")])
def test_bad_values_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}="):
        SamplingParams(**kwargs)
