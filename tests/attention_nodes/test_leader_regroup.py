"""The leader's side of losing an attention rank (Leader.regroup): the lost rank's requests go back to the
queue resumed from what they streamed, the in-flight header and the per-rank tables move to the new rank
numbers, and an abort meant for the lost rank ends its request at the leader."""
from __future__ import annotations

import itertools
import queue
from types import SimpleNamespace

import torch

from attention_nodes.block_pool import BlockPool
from attention_nodes.leader import Leader
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.worker import AttentionWorker
from comm.control import StepReport


def _leader(num_ranks: int) -> Leader:
    worker = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=64),
                             report=lambda: StepReport(0, 100, 0, 0, num_blocks=100),
                             kv=SimpleNamespace(bytes_per_token=0))
    return Leader(worker, num_ranks, block_size=16)


def _req(rid: str, n: int = 1, **kw) -> dict:
    return {"id": rid, "prompt": [5, 6, 7], "params": SamplingParams(max_tokens=8, n=n, **kw).to_dict()}


def _out(row, toks, finish=None, prompt_lps=None):
    return [row, toks, finish, prompt_lps, None, 0]


def test_lost_rank_requests_resume_and_ranks_are_renumbered():
    leader, outbox = _leader(3), queue.Queue()
    leader.outbox = outbox
    for req in (_req("a"), _req("b", n=2), _req("c", prompt_logprobs=0), _req("d"), _req("e"), _req("f")):
        leader.pending.append(req)
    leader.next_step({})                       # most free blocks, ties to the lowest rank: a0 b1 c2 d0 e1 f2
    assert leader.req2rank == {"a": 0, "b": 1, "c": 2, "d": 0, "e": 1, "f": 2}
    reps = [StepReport(r, 90, 2, 0) for r in range(3)]
    reps[1].outputs = [_out("b#0", [11]), _out("b#1", [12], "length"), _out("e", [13])]
    reps[2].outputs = [_out("c", [14], prompt_lps=[None, ({5: -1.0}, 1), ({6: -2.0}, 3)]), _out("f", [15])]
    leader.collect(reps, outbox)
    outbox.get_nowait()
    # the next step is in flight with a new request for rank 1 and aborts for ranks 1 and 2
    leader.reports[0].num_free_blocks = 0      # so g goes to rank 1 (rank 2 has fewer free blocks: 90 - 1)
    leader.reports[2].num_free_blocks = 80
    leader.pending.append(_req("g"))
    leader.inflight = leader.next_step({"1": ["e"], "2": ["f"]})
    assert leader.req2rank["g"] == 1 and list(leader.inflight.new_requests) == ["1"]
    leader.regroup([0, 2])                     # rank 1 was lost; rank 2 becomes rank 1

    # b: sample 1 finished, sample 0 resumes from its token; e was aborted in flight: it ends here;
    # g (assigned to the lost rank in the header in flight) starts over with nothing streamed
    moved = {r["id"]: r for r in leader.pending}
    assert list(moved) == ["b", "g"]
    assert moved["b"]["resume"] == {"0": [11]} and moved["g"]["resume"] == {"0": []}
    assert moved["b"]["prompt"] == [5, 6, 7] and moved["b"]["prompt_logprobs_sent"] == 0
    ended = outbox.get_nowait()
    assert ended == ("out", [["e", [], "abort", None, None, None]])
    assert leader.req2rank == {"a": 0, "c": 1, "d": 0, "f": 1}
    assert leader.inflight.new_requests == {} and leader.inflight.aborts == {"1": ["f"]}
    assert leader.num_attention_ranks == 2 and len(leader.reports) == len(leader.cached) == 2
    assert leader.num_moved_requests == 2
    # once re-assigned, a moved request keeps what it streamed: c's prompt logprobs are not re-sent
    leader.next_step({})
    assert leader.streamed["b"] == {0: [11], 1: [12]} and leader.finished["b"] == {1}
    assert leader.prompt_logprobs_sent["c"] == 3


def _moved(n: int, outputs: list) -> tuple[Leader, queue.Queue]:
    """A 2-rank leader whose request "b" (n samples) ran on rank 1 and reported outputs there."""
    leader, outbox = _leader(2), queue.Queue()
    leader.outbox = outbox
    leader.pending.append(_req("b", n=n))
    leader.next_step({})
    leader.req2rank["b"] = 1
    rep = [StepReport(0, 90, 0, 0), StepReport(1, 90, 1, 0)]
    rep[1].outputs = outputs
    leader.collect(rep, outbox)
    outbox.get_nowait()
    return leader, outbox


def test_a_moved_request_aborted_while_queued_ends_only_its_open_samples():
    leader, outbox = _moved(2, [_out("b#0", [1], "length"), _out("b#1", [2])])
    leader.regroup([0])
    assert [r["resume"] for r in leader.pending] == [{"1": [2]}]
    aborts: dict = {}
    leader.handle(("abort", "b"), aborts, outbox)
    assert outbox.get_nowait() == ("out", [["b#1", [], "abort", None, None, None]])    # b#0 had finished already
    assert not leader.pending and "b" not in leader.assigned and not aborts


def test_one_sample_aborted_while_queued_ends_that_sample_only():
    """A stop string ends one sample (the front aborts its sample id) while its request waits to be assigned
    again: the other samples go on from what they streamed."""
    leader, outbox = _moved(3, [_out("b#0", [1]), _out("b#1", [2]), _out("b#2", [3])])
    leader.regroup([0])
    aborts: dict = {}
    leader.handle(("abort", "b#1"), aborts, outbox)
    assert outbox.get_nowait() == ("out", [["b#1", [], "abort", None, None, None]])
    assert [r["resume"] for r in leader.pending] == [{"0": [1], "2": [3]}] and not aborts
    leader.handle(("abort", "b#1"), aborts, outbox)           # again: nothing more ends
    assert outbox.empty() and len(leader.pending) == 1
    # re-assigned, its two open samples finishing end the request
    leader.next_step({})
    rep = [StepReport(0, 90, 0, 0)]
    rep[0].outputs = [_out("b#0", [4], "length"), _out("b#2", [5], "length")]
    leader.collect(rep, outbox)
    assert "b" not in leader.assigned and not leader.has_work


def test_one_sample_of_a_request_never_assigned_ends_alone():
    leader, outbox = _leader(1), queue.Queue()
    leader.outbox = outbox
    leader.pending.append(_req("x", n=2))
    leader.handle(("abort", "x#0"), {}, outbox)
    assert outbox.get_nowait() == ("out", [["x#0", [], "abort", None, None, None]])
    assert [r["resume"] for r in leader.pending] == [{"1": []}]
    header = leader.next_step({})
    assert header.new_requests["0"][0]["resume"] == {"1": []} and leader.open_samples["x"] == 1


def test_open_samples_resumed_before_any_streamed_score_the_prompt_once():
    """Two of three samples resume before the prompt was scored: the rank that takes them reports each prompt
    logprob once (as one request's prefill does before it forks), not once per sample."""
    leader, outbox = _leader(1), queue.Queue()
    leader.outbox = outbox
    leader.pending.append(_req("x", n=3, prompt_logprobs=1))
    leader.handle(("abort", "x#0"), {}, outbox)
    req = leader.next_step({}).new_requests["0"][0]
    assert req["resume"] == {"1": [], "2": []}
    arrivals = itertools.count()
    worker = SimpleNamespace(scheduler=Scheduler(BlockPool(8, 4), 4, 64), next_arrival=lambda: next(arrivals),
                             device=torch.device("cpu"))
    AttentionWorker.add_requests(worker, [req])
    scored = {s.request_id: list(s.prompt_logprob_positions(0, 3)) for s in worker.scheduler.waiting}
    assert scored == {"x#1": [0, 1], "x#2": []}


def test_a_sample_abort_in_flight_to_a_lost_rank_ends_that_sample_only():
    leader, outbox = _moved(2, [_out("b#0", [1]), _out("b#1", [2])])
    leader.inflight = leader.next_step({"1": ["b#0"]})
    leader.regroup([0])
    assert outbox.get_nowait() == ("out", [["b#0", [], "abort", None, None, None]])
    assert [r["resume"] for r in leader.pending] == [{"1": [2]}] and leader.open_samples["b"] == 1


def test_joining_ranks_get_fresh_tables_and_take_new_requests():
    leader, outbox = _leader(2), queue.Queue()
    leader.outbox = outbox
    leader.pending.extend([_req("a"), _req("b")])
    leader.next_step({})
    assert leader.req2rank == {"a": 0, "b": 1}
    leader.cached[1].add(7)
    leader.regroup([0, 1, -1, -1], kv_blocks=[300, 50])     # two ranks join with their own KV pools
    assert [r.rank for r in leader.reports] == [0, 1, 2, 3]
    assert [r.num_free_blocks for r in leader.reports[2:]] == [300, 50]
    assert leader.cached == [set(), {7}, set(), set()] and not leader.pending
    assert leader.req2rank == {"a": 0, "b": 1} and leader.num_moved_requests == 0
    leader.pending.append(_req("c"))
    leader.next_step({})
    assert leader.req2rank["c"] == 2           # the joiner with the most free blocks
