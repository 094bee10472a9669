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
    client._deliver([[ids[0], [5], None, None, None, 0], [ids[1], [6], None, None, None, 0],
                     ["gone", [7], None, None, None, 0], [ids[0], [8], "length", None, None, 0]])
    assert len(loop.calls) == 1
    fn, args = loop.calls[0]
    fn(*args)
    got = [[(p.token_ids, p.finish) for p in (s.get_nowait() for _ in range(s.qsize()))] for s in sinks]
    assert got == [[([5], None), ([8], "length")], [([6], None)]]


def test_the_finish_reason_counted_is_the_one_the_client_sees():
    """A finished sample's reason is counted when its handler says how it ended (a stop string in the last tokens
    turns the engine's "length" into "stop"); released before that, the engine's own reason; released while still
    running, the release's, and only then is the engine told to abort."""
    import queue

    leader = Leader()
    leader.inbox = queue.Queue()
    metrics = Metrics()
    client = EngineClient(leader, metrics)
    client.loop = Loop()

    def counted(reason):
        return metrics.registry.get_sample_value("afserve_requests_finished_total", {"finish_reason": reason}) or 0

    a, b, c = (client.submit([1, 2], SamplingParams(), asyncio.Queue()) for _ in range(3))
    client._deliver([[a, [5], "length", None, None, 0], [b, [6], "length", None, None, 0],
                     [c, [7], None, None, None, 0]])
    assert counted("length") == counted("stop") == 0       # not yet: the handlers have not looked at the text
    client.finished(a, "stop")                             # its stop string ended the last token's text
    assert (counted("stop"), counted("length")) == (1, 0)
    client.release(b, "abort")                             # its client left after the engine had finished it
    assert counted("length") == 1 and leader.inbox.empty()
    client.release(c, "abort")                             # still running: aborted in the engine
    assert counted("abort") == 1 and leader.inbox.get_nowait() == ("abort", c)
    client.finished(a, "stop")                             # once only
    assert counted("stop") == 1 and not client._tracks and not client._samples


def test_a_stream_whose_client_left_before_its_body_started_is_aborted():
    """The client is gone by the time the handler returns its streamed response (uvicorn's ASGI 2.3: Starlette
    cancels the body as soon as it listens for the disconnect). The body still runs up to its first wait, where
    the cancellation reaches _drive's cleanup, which aborts every request the handler submitted, once."""
    from types import SimpleNamespace

    from launch.frontend.generate import respond
    from launch.frontend.protocol import CompletionRequest

    released = []

    class Engine:
        llm = SimpleNamespace(tokenizer=None, spec=SimpleNamespace(eos_token_ids=(2,)))

        def submit(self, ids, params, sink):
            return f"r{len(ids)}"

        def release(self, rid, reason):
            released.append((rid, reason))

    body = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3, 4, 5]], "stream": True})
    request = SimpleNamespace(state=SimpleNamespace())
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message["type"])

    async def serve():
        response = await respond("m", Engine(), body, request, [[1, 2], [3, 4, 5]], [SamplingParams()] * 2,
                                  chat=False)
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    asyncio.run(serve())
    assert "http.response.body" not in sent          # no token was ever sent
    assert sorted(released) == [("r2", "abort"), ("r3", "abort")]
