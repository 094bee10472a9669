"""The HTTP front's bridge to the engine: `EngineClient` puts commands on an `LLM`'s inbox and routes what comes
back on its outbox to the asyncio handlers waiting for it.

Threads: the leader loop owns its queues; `EngineClient` runs one router thread that reads the leader's
outbox and hands each request's progress to the asyncio handler waiting for it (call_soon_threadsafe), and
records latency metrics as tokens arrive. Handlers put commands ("add", "abort", "stats", "comm_stats",
"reset_prefix_cache", "scale") on the leader's inbox.

A request drawing several samples (SamplingParams.num_samples > 1) has one track per sample, under the
sample's id (`sample_ids`), and its latency metrics (TTFT, TPOT, e2e, finish reason) are recorded per sample,
as vLLM v1 records them per child request; its prompt tokens count once. A sample the engine has finished keeps
its track until its handler says how it ended (`finished`: a stop string in the last tokens makes a "length" a
"stop"), or lets it go (`release`: the engine's reason, or the handler's for one still running).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from attention_nodes.sampling_params import SamplingParams

from ..procs import Answers
from ..samples import sample_ids
from .metrics import Metrics
from .protocol import APIError

logger = logging.getLogger("afserve.http")

QUERY_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Progress:
    """One sample's progress as its handler receives it: one leader outbox row. request_id: the row's id (the
    request's, or one sample's: `sample_ids`). token_ids None: the engine went down, and finish says why."""

    request_id: str
    token_ids: list[int] | None
    finish: str | None
    prompt_logprobs: list | None = None    # new prompt positions, (entry, rank) or None (None: none asked)
    logprobs: list[dict[int, float]] | None = None                 # one per new token (None: none asked)
    num_cached_tokens: int | None = None   # the request's prompt tokens found cached (None: an abort's row)


@dataclass(slots=True, eq=False)
class _Track:
    """One sample of an engine request as the router sees it."""

    request_id: str
    sink: asyncio.Queue
    arrival: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    finish: str | None = None      # the engine's finish reason, once it has finished the sample
    end: float | None = None       # when that finish arrived
    interval: int = 1              # the fewest new tokens a chunk carries (the server's, or the request's if more)
    held: Progress | None = None   # rows not handed over yet (stream_interval), merged
    handed_tokens: int = 0         # tokens handed to the handler so far


class EngineClient:
    """Bridges an LLM's inbox/outbox queues to asyncio handlers. stream_interval (vLLM's --stream-interval): a
    sample's tokens go to its handler, and so to a streaming client, once at least that many have come since the
    last they got, or with its first token, or when it finishes (1: every step's); fewer, larger chunks cost the
    front and the client less per token. A request's SamplingParams.stream_interval raises it for that request
    (vLLM's: never lowers it)."""

    def __init__(self, llm, metrics: Metrics, stream_interval: int = 1):
        self.llm = llm
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}           # sample id -> its track, while open
        self._samples: dict[str, list[str]] = {}       # request id -> its sample ids, while any is open
        self._waiters: dict[str, deque] = {k: deque() for k in Answers.KINDS}   # the leader's answers' kinds
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._route, name="afserve-router", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    # ----- called from asyncio handlers ---------------------------------------------------------------------
    def submit(self, ids: list[int], params: SamplingParams, sink: asyncio.Queue) -> str:
        """Queue a request whose progress goes to sink; returns its request id (its samples' ids:
        `sample_ids(request id, params.num_samples)`)."""
        with self._lock:   # registered before the router can see the request's first tokens
            if self.dead:  # checked under the lock that fail() sets it under: no track is left after fail()
                raise engine_down(self.dead)
            rid = self.llm.enqueue(ids, params)   # the handler checked ids and params already
            now = time.monotonic()
            self._samples[rid] = sample_ids(rid, params.num_samples)
            interval = max(self.stream_interval, params.stream_interval or 1)
            for sid in self._samples[rid]:
                self._tracks[sid] = _Track(rid, sink, now, interval=interval)
        self.metrics.prompt.inc(len(ids))
        return rid

    def release(self, some_id: str, reason: str) -> None:
        """The front is done with a request (its id: every sample still open; client gone, error) or with one
        sample (its id: a stop string): abort what of it still runs in the engine."""
        with self._lock:
            owner = self._tracks[some_id].request_id if some_id in self._tracks else some_id
            if owner not in self._samples:
                return
            ids = self._samples[owner] if some_id == owner else [some_id]
            tracks = [t for t in (self._tracks.pop(i, None) for i in ids) if t is not None]
            self._forget_if_done(owner)
        if any(t.finish is None for t in tracks):
            self.llm.inbox.put(("abort", some_id))   # a request id aborts each of its samples still running
        for track in tracks:
            self._record_finish(track, track.finish or reason)

    def finished(self, sample_id: str, reason: str) -> None:
        """The handler has seen the engine finish a sample and says how it ended (its finish_reason)."""
        with self._lock:
            track = self._tracks.pop(sample_id, None)
            if track is None:
                return
            self._forget_if_done(track.request_id)
        self._record_finish(track, reason)

    def _forget_if_done(self, rid: str) -> None:
        """Drop rid's sample list once none of its samples is open (with the lock held)."""
        if not any(i in self._tracks for i in self._samples[rid]):
            del self._samples[rid]

    async def query(self, kind: str, *args, timeout_s: float = QUERY_TIMEOUT_S) -> dict:
        """("stats",), ("comm_stats",), ("reset_prefix_cache",) or ("scale", request) through the leader; the
        answer comes back on the outbox."""
        fut = self.loop.create_future()
        with self._lock:
            if self.dead:
                raise engine_down(self.dead)
            self._waiters[kind].append(fut)
            self.llm.inbox.put((kind, *args))
        return await asyncio.wait_for(fut, timeout_s)

    # ----- router thread -----------------------------------------------------------------------------------
    def _route(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self.llm.outbox.get(timeout=0.2)
            except queue.Empty:
                try:
                    self.llm.check_alive()
                except RuntimeError as e:
                    self.fail(str(e))
                    return
                continue
            if msg[0] == "out":
                self._deliver(msg[1])
            elif msg[0] == "autoscaled":
                self.llm.take_scale_result(msg[1], autoscaled=True)
            elif msg[0] in self._waiters:
                with self._lock:
                    fut = self._waiters[msg[0]].popleft() if self._waiters[msg[0]] else None
                if fut is not None:
                    self.loop.call_soon_threadsafe(_resolve, fut, msg[1])

    def _deliver(self, outputs: list) -> None:
        """outputs: the leader's rows [request or sample id, [new token ids], finish_reason or None, new prompt
        logprobs or None, new token logprobs or None, cached prompt tokens or None]; each goes to its handler's
        sink as a `Progress`, all of them in one callback on the loop (each call_soon_threadsafe wakes the loop
        through its self-pipe)."""
        now = time.monotonic()
        handed: list[tuple[asyncio.Queue, Progress]] = []
        with self._lock:
            for row in outputs:
                got = Progress(*row)
                rid, toks, finish = got.request_id, got.token_ids, got.finish
                track = self._tracks.get(rid)
                if track is None:       # released by the front (its abort is on the way)
                    continue
                if toks:
                    if track.first is None:
                        track.first = now
                        self.metrics.ttft.observe(now - track.arrival)
                    track.last = now
                    track.num_tokens += len(toks)
                    self.metrics.generated.inc(len(toks))
                if finish is not None:         # recorded once the handler says how it ended (`finished`)
                    track.finish, track.end = finish, now
                got = self._interval(track, got)
                if got is not None:
                    handed.append((track.sink, got))
            if handed:      # under the lock, as before: ahead of anything fail() hands the same sinks
                self.loop.call_soon_threadsafe(_hand_over, handed)

    def _interval(self, track: _Track, got: Progress) -> Progress | None:
        """got merged after the rows held back for track; None while stream_interval holds it back too."""
        if track.held is not None:
            got, track.held = _merge(track.held, got), None
        if (got.finish is None and track.handed_tokens and got.token_ids
                and len(got.token_ids) < track.interval):
            track.held = got
            return None
        track.handed_tokens += len(got.token_ids)
        return got

    def _record_finish(self, track: _Track, reason: str) -> None:
        now = track.end or time.monotonic()
        self.metrics.e2e.observe(now - track.arrival)
        if track.num_tokens > 1:
            self.metrics.tpot.observe((track.last - track.first) / (track.num_tokens - 1))
        self.metrics.finished.labels(reason).inc()

    def fail(self, why: str) -> None:
        """Fail every open request and query with a 503 naming why (the engine is gone or stopping)."""
        logger.warning("failing open requests: %s", why)
        with self._lock:
            self.dead = why
            tracks, self._tracks, self._samples = list(self._tracks.items()), {}, {}
            waiters = [f for q in self._waiters.values() for f in q]
            for q in self._waiters.values():
                q.clear()
        for rid, track in tracks:
            if track.finish is not None:     # finished in the engine, its last row already handed over
                self._record_finish(track, track.finish)
            else:
                self.loop.call_soon_threadsafe(track.sink.put_nowait, Progress(rid, None, why))
        for fut in waiters:
            self.loop.call_soon_threadsafe(_resolve, fut, engine_down(why))


def _merge(a: Progress, b: Progress) -> Progress:
    """Two consecutive rows of one sample as one."""
    def cat(x: list | None, y: list | None) -> list | None:
        return None if x is None and y is None else (x or []) + (y or [])
    return Progress(b.request_id, a.token_ids + b.token_ids, b.finish, cat(a.prompt_logprobs, b.prompt_logprobs),
                    cat(a.logprobs, b.logprobs), b.num_cached_tokens if a.num_cached_tokens is None else
                    a.num_cached_tokens)


def engine_down(why: str) -> APIError:
    return APIError(503, f"the engine is down: {why}", kind="server_error", code="engine_dead")


def _hand_over(handed: list[tuple[asyncio.Queue, Progress]]) -> None:
    for sink, got in handed:
        sink.put_nowait(got)


def _resolve(fut: asyncio.Future, value) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
