"""Sequence: construction, token bookkeeping and the finish rules."""
import pytest
import torch

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import Sequence, SequenceStatus

EOS = frozenset({2})


def make_seq(prompt_len: int = 3, arrival: int = 0, **params) -> Sequence:
    return Sequence.from_request(f"r{arrival}", list(range(10, 10 + prompt_len)),
                                 SamplingParams(**params), arrival)


def test_from_request_defaults():
    prompt = [5, 6, 7]
    seq = Sequence.from_request("a", prompt, SamplingParams(), 4)
    prompt.append(99)  # the sequence keeps its own copy
    assert seq.token_ids == [5, 6, 7] and seq.num_prompt_tokens == 3 and seq.arrival == 4
    assert seq.num_tokens == 3 and seq.output_token_ids == [] and seq.num_output_tokens == 0
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert seq.num_computed_tokens == 0 and seq.block_table == [] and seq.num_preemptions == 0
    assert seq.finish_reason is None and seq.generator is None


def test_seed_creates_reproducible_generator():
    a, b = make_seq(seed=7), make_seq(seed=7)
    assert isinstance(a.generator, torch.Generator) and a.generator is not b.generator
    assert torch.equal(torch.rand(4, generator=a.generator), torch.rand(4, generator=b.generator))


def test_empty_prompt_raises():
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence.from_request("x", [], SamplingParams(), 0)


def test_append_without_finish():
    seq = make_seq(max_tokens=5)
    assert seq.append_token(40, EOS, 100) is None
    assert seq.append_token(41, EOS, 100) is None
    assert seq.output_token_ids == [40, 41] and seq.num_output_tokens == 2 and seq.num_tokens == 5
    assert seq.status is SequenceStatus.WAITING and seq.finish_reason is None


def test_stop_token_finishes_with_stop_and_is_kept():
    seq = make_seq(stop_token_ids=[9])
    assert seq.append_token(9, EOS, 100) == "stop"
    assert seq.is_finished and seq.finish_reason == "stop" and seq.output_token_ids == [9]


def test_eos_finishes_with_stop():
    seq = make_seq()
    assert seq.append_token(2, EOS, 100) == "stop"
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "stop"


def test_ignore_eos_keeps_going_until_max_tokens():
    seq = make_seq(max_tokens=3, ignore_eos=True)
    assert seq.append_token(2, EOS, 100) is None
    assert seq.append_token(2, EOS, 100) is None
    assert seq.append_token(2, EOS, 100) == "length"
    assert seq.output_token_ids == [2, 2, 2]


def test_ignore_eos_does_not_ignore_stop_token_ids():
    seq = make_seq(ignore_eos=True, stop_token_ids=[2])
    assert seq.append_token(2, EOS, 100) == "stop"


def test_max_tokens_finishes_with_length():
    seq = make_seq(max_tokens=2)
    assert seq.append_token(40, EOS, 100) is None
    assert seq.append_token(41, EOS, 100) == "length"
    assert seq.finish_reason == "length" and seq.num_output_tokens == 2


def test_max_model_len_finishes_with_length():
    seq = make_seq(prompt_len=3, max_tokens=50)
    assert seq.append_token(40, EOS, 5) is None
    assert seq.append_token(41, EOS, 5) == "length"
    assert seq.num_tokens == 5


def test_stop_is_checked_before_length():
    seq = make_seq(max_tokens=1, stop_token_ids=[9])
    assert seq.append_token(9, EOS, 100) == "stop"
    seq = make_seq(max_tokens=1)
    assert seq.append_token(2, EOS, 4) == "stop"  # EOS on the last allowed token still says "stop"


def test_append_after_finish_is_internal_error():
    seq = make_seq(max_tokens=1)
    seq.append_token(40, EOS, 100)
    with pytest.raises(AssertionError):
        seq.append_token(41, EOS, 100)
