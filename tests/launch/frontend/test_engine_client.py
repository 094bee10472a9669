"""The front's router thread (launch/frontend/engine_client.py): how a leader message's rows reach the handlers."""
from __future__ import annotations

import asyncio

from attention_nodes.sampling_params import SamplingParams
from launch.frontend.engine_client import EngineClient
from launch.frontend.metrics import Metrics


class Leader:      # what submit needs of the front's LLM
    def __init__(self):
        self.n = 0

    def enqueue(self, ids, params):
        self.n += 1
        return f"r{self.n}"


class Loop:        # records what the router thread hands the event loop
    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))


def test_a_steps_progress_reaches_the_event_loop_in_one_callback_in_order():
    """The router thread hands every row of one leader message to the loop at once (each call_soon_threadsafe
    wakes the loop through its self-pipe), each to its own handler's sink, in order; rows of requests the front
    released are dropped."""
    client = EngineClient(Leader(), Metrics())
    client.loop = loop = Loop()
    sinks = [asyncio.Queue(), asyncio.Queue()]
    ids = [client.submit([1, 2], SamplingParams(), s) for s in sinks]
    client._deliver([[ids[0], [5], None, None, None], [ids[1], [6], None, None, None], ["gone", [7], None, None, None],
                     [ids[0], [8], "length", None, None]])
    assert len(loop.calls) == 1
    fn, args = loop.calls[0]
    fn(*args)
    got = [[(p.token_ids, p.finish) for p in (s.get_nowait() for _ in range(s.qsize()))] for s in sinks]
    assert got == [[([5], None), ([8], "length")], [([6], None)]]
