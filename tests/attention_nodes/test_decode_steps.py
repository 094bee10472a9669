"""Which steps the sync audit calls decode steps: an attention rank's own batch (SchedulerOutput.is_decode) and
the leader's header flag for expert ranks (Leader.next_step)."""
from __future__ import annotations

from types import SimpleNamespace

from attention_nodes.block_pool import BlockPool
from attention_nodes.leader import Leader
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence
from comm.control import StepReport

EOS = frozenset({2})


def make_seq(arrival: int, prompt_len: int) -> Sequence:
    return Sequence.from_request(f"r{arrival}", [100 + i for i in range(prompt_len)],
                                 SamplingParams(max_tokens=8), arrival)


def run(sched: Scheduler) -> bool:
    """One step sampling token 7 -> whether its batch was decode-only."""
    out = sched.schedule()
    sched.update(out, [7 if s.needs_sample else None for s in out.scheduled], EOS, 1000)
    return out.is_decode


def test_a_batch_is_decode_when_every_sequence_computes_one_generated_token():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=5)
    assert sched.schedule().is_decode                  # nothing scheduled
    sched.add(make_seq(0, 6))
    assert [run(sched), run(sched)] == [False, False]  # chunks of 5 and 1: the 1-token chunk is still prompt
    assert run(sched)                                  # one generated token
    sched.add(make_seq(1, 1))
    assert not run(sched)                              # a decode beside a one-token prompt
    assert run(sched)


def report(rank: int, running: int, next_tokens: int, waiting: int = 0) -> StepReport:
    return StepReport(rank, 100, running, waiting, next_tokens, num_blocks=100)


def test_the_header_says_decode_when_no_rank_takes_a_prompt():
    worker = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=64),
                             report=lambda: StepReport(0, 100, 0, 0, num_blocks=100),
                             kv=SimpleNamespace(bytes_per_token=0))
    leader = Leader(worker, 2, block_size=16)
    leader.reports = [report(0, 3, 3), report(1, 0, 0)]
    assert leader.next_step({}).is_decode
    leader.reports = [report(0, 3, 3), report(1, 2, 9)]          # rank 1 has prompt chunks left
    assert not leader.next_step({}).is_decode
    leader.reports = [report(0, 3, 3), report(1, 0, 4, waiting=1)]
    assert not leader.next_step({}).is_decode
    leader.reports = [report(0, 3, 3), report(1, 0, 0)]
    leader.pending.append({"id": "a", "prompt": [5, 6], "params": SamplingParams().to_dict()})
    header = leader.next_step({})
    assert header.new_requests and not header.is_decode
