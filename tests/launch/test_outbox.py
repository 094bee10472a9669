"""The leader's outbox (launch/procs.py Outbox): a pipe from the leader's own thread to one reader process."""
import logging
import multiprocessing as mp
import queue

import pytest

from launch.procs import OUTBOX_PIPE_BYTES, Outbox


def _write(outbox: Outbox, n: int) -> None:
    for i in range(n):
        outbox.put(("out", [[f"r{i}", [i, i + 1], None if i % 3 else "stop", None, None]]))
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
    assert got[:300] == [("out", [[f"r{i}", [i, i + 1], None if i % 3 else "stop", None, None]]) for i in range(300)]
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
