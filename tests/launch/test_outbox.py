"""The leader's outbox (launch/procs.py Outbox): a pipe from the leader's own thread to one reader process."""
import logging
import multiprocessing as mp
import queue
import threading
import time

import pytest

from launch.procs import OUTBOX_PIPE_BYTES, LocalOutbox, Outbox


def _write(outbox: Outbox, n: int) -> None:
    for i in range(n):
        outbox.put(("out", [[f"r{i}", [i, i + 1], None if i % 3 else "stop", None, None, 0]]))
    outbox.put(("big", b"x" * (3 * OUTBOX_PIPE_BYTES)))   # larger than the pipe: the put waits for the reader
    outbox.put(("done", n))


def test_messages_from_another_process_arrive_whole_and_in_order():
    ctx = mp.get_context("spawn")
    outbox = Outbox(ctx)
    proc = ctx.Process(target=_write, args=(outbox, 300))
    proc.start()
    got = [outbox.get(timeout=60) for _ in range(302)]
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert got[:300] == [("out", [[f"r{i}", [i, i + 1], None if i % 3 else "stop", None, None, 0]]) for i in range(300)]
    assert got[300] == ("big", b"x" * (3 * OUTBOX_PIPE_BYTES)) and got[301] == ("done", 300)
    with pytest.raises(queue.Empty):
        outbox.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        outbox.get_nowait()


def test_a_put_after_the_reader_has_gone_drops_the_message(caplog):
    outbox = Outbox(mp.get_context("spawn"))
    outbox.close_reader()
    with caplog.at_level(logging.WARNING, logger="afserve"):
        outbox.put(("out", []))
        outbox.put(("out", []))
    assert [r.getMessage() for r in caplog.records].count(
        "the leader's progress reader has gone; its outbox messages are dropped from now on") == 1


def _write_too_much(outbox: Outbox) -> None:
    outbox.put(("small", 1))
    outbox.put(("big", b"x" * (4 * OUTBOX_PIPE_BYTES)))   # the pipe fills: the writer is killed in the middle


def test_a_writer_dying_inside_a_message_leaves_get_timing_out_not_stuck():
    """The leader dying in the middle of writing a message: get() times out (its caller then sees the dead
    rank) instead of waiting forever in a read for the rest, which never comes while any process holds the
    pipe's write end (this one does)."""
    ctx = mp.get_context("spawn")
    outbox = Outbox(ctx)
    proc = ctx.Process(target=_write_too_much, args=(outbox,))
    proc.start()
    assert outbox.get(timeout=60) == ("small", 1)
    time.sleep(2.0)                                   # the writer is blocked with the pipe full
    proc.kill()
    proc.join(timeout=30)
    got = []
    reader = threading.Thread(target=lambda: got.append(_get_or_empty(outbox, 0.5)), daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert not reader.is_alive() and got == ["empty"]


def _get_or_empty(outbox: Outbox, timeout: float):
    try:
        return outbox.get(timeout=timeout)
    except queue.Empty:
        return "empty"


def test_put_back_messages_come_out_first_in_order():
    outbox = Outbox(mp.get_context("spawn"))
    for i in range(4):
        outbox.put(("out", i))
    taken = [outbox.get(timeout=5), outbox.get(timeout=5)]
    outbox.put_back(taken)
    assert [outbox.get(timeout=5) for _ in range(4)] == [("out", i) for i in range(4)]
    local = LocalOutbox()
    local.put(("out", 2))
    local.put_back([("out", 0), ("out", 1)])
    assert [local.get(timeout=5) for _ in range(3)] == [("out", i) for i in range(3)]


def test_a_reader_waiting_holds_back_neither_another_readers_timeout_nor_put_back():
    """Two threads of the reading process: one waiting long on an empty outbox lets the other time out on its
    own, shorter, timeout and put messages back, which the first then gets."""
    outbox = Outbox(mp.get_context("spawn"))
    got = []
    waiting = threading.Thread(target=lambda: got.append(_get_or_empty(outbox, 60)), daemon=True)
    waiting.start()
    time.sleep(0.3)                                   # the first reader is in its wait
    assert _get_or_empty(outbox, 0.2) == "empty"
    assert waiting.is_alive() and not got             # timed out before the first reader's wait ended
    outbox.put_back([("out", 7)])
    waiting.join(timeout=30)
    assert not waiting.is_alive() and got == [("out", 7)]
