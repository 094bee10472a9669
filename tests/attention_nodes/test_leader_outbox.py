"""The leader's outbox: progress of a request added with "stream": False (what LLM.generate adds) is held back
and sent, in order and whole, in one message once a step finishes some request, a streamed request makes
progress, the leader runs out of work or HOLD_STEPS steps are held; streamed requests go out every step."""
from __future__ import annotations

import queue

from attention_nodes.leader import HOLD_STEPS
from comm.control import StepReport
from tests.attention_nodes.test_leader_regroup import _leader, _out, _req


def _drain(outbox: queue.Queue) -> list:
    msgs = []
    while not outbox.empty():
        msgs.append(outbox.get_nowait())
    return msgs


def _step(leader, outbox, outputs, running: int = 2) -> list:
    rep = StepReport(0, 90, running, 0)
    rep.outputs = outputs
    leader.collect([rep], outbox)
    return _drain(outbox)


def _added(leader, *reqs) -> None:
    for req, stream in reqs:
        leader.handle(("add", req if stream else dict(req, stream=False)), {}, queue.Queue())
    leader.next_step({})


def test_final_only_progress_is_held_until_a_request_finishes():
    leader, outbox = _leader(1), queue.Queue()
    _added(leader, (_req("a"), False), (_req("b"), False))
    assert "stream" not in leader.assigned["a"]     # the flag stays with the leader, not sent to the ranks
    assert _step(leader, outbox, [_out("a", [1]), _out("b", [2])]) == []
    assert _step(leader, outbox, [_out("a", [3]), _out("b", [4])]) == []
    sent = _step(leader, outbox, [_out("a", [5], "length"), _out("b", [6])])
    assert sent == [("out", [_out("a", [1]), _out("b", [2]), _out("a", [3]), _out("b", [4]),
                             _out("a", [5], "length"), _out("b", [6])])]
    assert _step(leader, outbox, [_out("b", [7])], running=1) == []
    # nothing left to run: whatever is held goes out even without a finish
    assert _step(leader, outbox, [_out("b", [8])], running=0) == [("out", [_out("b", [7]), _out("b", [8])])]
    assert leader.held == []


def test_at_most_hold_steps_steps_are_held():
    leader, outbox = _leader(1), queue.Queue()
    _added(leader, (_req("a"), False))
    for t in range(1, HOLD_STEPS):
        assert _step(leader, outbox, [_out("a", [t])]) == []
    assert _step(leader, outbox, [_out("a", [HOLD_STEPS])]) == [("out", [_out("a", [t]) for t in
                                                                        range(1, HOLD_STEPS + 1)])]
    assert _step(leader, outbox, []) == [] and leader.held_steps == 0   # a step with no progress holds nothing
    assert _step(leader, outbox, [_out("a", [0])]) == [] and leader.held_steps == 1


def test_a_streamed_request_sends_every_step_and_carries_the_held_ones():
    leader, outbox = _leader(1), queue.Queue()
    _added(leader, (_req("a"), False), (_req("s"), True))
    assert _step(leader, outbox, [_out("a", [1])]) == []
    assert _step(leader, outbox, [_out("a", [2]), _out("s", [9])]) == [
        ("out", [_out("a", [1]), _out("a", [2]), _out("s", [9])])]
    assert _step(leader, outbox, [_out("s", [10])]) == [("out", [_out("s", [10])])]


def test_other_messages_follow_the_held_outputs():
    leader, outbox = _leader(1), queue.Queue()
    _added(leader, (_req("a"), False))
    assert _step(leader, outbox, [_out("a", [1])]) == []
    leader.pending.append(_req("q"))                 # queued, not assigned: an abort ends it at the leader
    leader.handle(("abort", "q"), {}, outbox)
    leader.handle(("stats",), {}, outbox)
    sent = _drain(outbox)
    assert sent[:2] == [("out", [_out("a", [1])]), ("out", [["q", [], "abort", None, None, None]])]
    assert sent[2][0] == "stats" and len(sent) == 3
    # a finished final-only request is forgotten with its flag
    _step(leader, outbox, [_out("a", [2], "stop")])
    assert "a" not in leader.final_only and "a" not in leader.assigned
