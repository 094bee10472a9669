"""The OpenAI-compatible HTTP front: FastAPI app over an `LLM` whose leader runs in this process (torchrun,
attention rank 0) or in a spawned rank (a plain process).

Threads: the leader loop owns its queues; `EngineClient` runs one router thread that reads the leader's
outbox and hands each request's tokens to the asyncio handler waiting for them (call_soon_threadsafe), and
records latency metrics as tokens arrive. Handlers put commands ("add", "abort", "stats", "comm_stats") on
the leader's inbox. Stop strings, detokenisation and SSE framing happen here; the engine sees token ids.
A request whose client goes away (stream closed or connection dropped) is aborted, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from attention_nodes.sampling_params import SamplingParams

from .protocol import APIError, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("afserve.http")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)
QUERY_TIMEOUT_S = 60.0


class Metrics:
    """Prometheus series the front records itself; engine-side series are read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("afserve_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("afserve_time_per_output_token_seconds",
                              "Mean time between generated tokens of a finished request (TPOT / ITL)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("afserve_e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.generated = Counter("afserve_generation_tokens", "Generated tokens", registry=r)
        self.prompt = Counter("afserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.finished = Counter("afserve_requests_finished", "Finished requests by reason", ["finish_reason"],
                                registry=r)


@dataclass(slots=True, eq=False)
class _Track:
    """One engine request as the router sees it."""

    sink: asyncio.Queue
    arrival: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0


class EngineClient:
    """Bridges an LLM's inbox/outbox queues to asyncio handlers."""

    def __init__(self, llm, metrics: Metrics):
        self.llm = llm
        self.metrics = metrics
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._waiters: dict[str, deque] = {"stats": deque(), "comm_stats": deque()}
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
        if self.dead:
            raise _engine_down(self.dead)
        with self._lock:   # registered before the router can see the request's first tokens
            rid = self.llm.enqueue(ids, params)   # the handler checked ids and params already
            self._tracks[rid] = _Track(sink, time.monotonic())
        self.metrics.prompt.inc(len(ids))
        return rid

    def release(self, rid: str, reason: str) -> None:
        """The front is done with rid (stop string, client gone, error): abort it in the engine if it runs."""
        with self._lock:
            track = self._tracks.pop(rid, None)
        if track is not None:
            self.llm.inbox.put(("abort", rid))
            self._record_finish(track, reason)

    async def query(self, kind: str) -> dict:
        """("stats",) or ("comm_stats",) through the leader; the answer comes back on the outbox."""
        if self.dead:
            raise _engine_down(self.dead)
        fut = self.loop.create_future()
        with self._lock:
            self._waiters[kind].append(fut)
            self.llm.inbox.put((kind,))
        return await asyncio.wait_for(fut, QUERY_TIMEOUT_S)

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
            elif msg[0] in self._waiters:
                with self._lock:
                    fut = self._waiters[msg[0]].popleft() if self._waiters[msg[0]] else None
                if fut is not None:
                    self.loop.call_soon_threadsafe(_resolve, fut, msg[1])

    def _deliver(self, outputs: list) -> None:
        now = time.monotonic()
        with self._lock:
            for rid, toks, finish, _ in outputs:
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
                if finish is not None:
                    del self._tracks[rid]
                    self._record_finish(track, finish)
                self.loop.call_soon_threadsafe(track.sink.put_nowait, (rid, toks, finish))

    def _record_finish(self, track: _Track, reason: str) -> None:
        now = time.monotonic()
        self.metrics.e2e.observe(now - track.arrival)
        if track.num_tokens > 1:
            self.metrics.tpot.observe((track.last - track.first) / (track.num_tokens - 1))
        self.metrics.finished.labels(reason).inc()

    def fail(self, why: str) -> None:
        """Fail every open request and query with a 503 naming why (the engine is gone or stopping)."""
        logger.warning("failing open requests: %s", why)
        self.dead = why
        with self._lock:
            tracks, self._tracks = list(self._tracks.items()), {}
            waiters = [f for q in self._waiters.values() for f in q]
            for q in self._waiters.values():
                q.clear()
        for rid, track in tracks:
            self.loop.call_soon_threadsafe(track.sink.put_nowait, (rid, None, why))
        for fut in waiters:
            self.loop.call_soon_threadsafe(_resolve, fut, _engine_down(why))


def _engine_down(why: str) -> APIError:
    return APIError(503, f"the engine is down: {why}", kind="server_error", code="engine_dead")


def _resolve(fut: asyncio.Future, value) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


class TextStream:
    """Generated ids -> text pieces, with stop strings. A piece is held back while it could still become a stop
    string or while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def add(self, toks: list[int], final: bool) -> str:
        """Append tokens; returns the new text to send. Sets `stopped` when a stop string appeared (the text
        ends before it)."""
        self.ids.extend(toks)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stops:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                text, final, self.stopped = text[:min(hits)], True, True
        end = len(text)
        if not final:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        piece = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece


@dataclass(slots=True)
class _Choice:
    index: int
    prompt_len: int
    stream: TextStream
    num_tokens: int = 0
    finish: str | None = None
    text: list[str] = field(default_factory=list)


class _ServerState:
    def __init__(self, model_name: str, model_path: str, api_key: str | None):
        self.model_name, self.model_path, self.api_key = model_name, model_path, api_key
        self.engine: EngineClient | None = None
        self.metrics = Metrics()
        self.created = int(time.time())
        self.scrape_lock = asyncio.Lock()       # one stats collective at a time
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_ready = threading.Event()


def build_app(model_name: str, model_path: str, api_key: str | None = None) -> FastAPI:
    """The app; `attach(app, llm)` connects it to an engine once every rank is ready (until then /health and
    the API answer 503)."""
    state = _ServerState(model_name, model_path, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.loop_ready.set()
        yield
        if state.engine is not None:
            state.engine.close()

    app = FastAPI(title="afserve", description="OpenAI-compatible API of an attention/FFN-disaggregated MoE runtime",
                  version="0.1.0", lifespan=lifespan)
    app.state.afserve = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:
            where = ".".join(loc) or "body"
            msg = f"{where}: {first.get('msg', 'invalid value')} (got {_short(first.get('input'))})"
            if len(errs) > 1:
                msg += f"; and {len(errs) - 1} more problem(s)"
        param = None if first.get("type") == "json_invalid" else ".".join(loc) or None
        return JSONResponse(APIError(400, msg, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind=kind).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(),
                            status_code=500)

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def engine() -> EngineClient:
        if state.engine is None:
            raise APIError(503, "the server is still loading the model; retry when /health answers 200",
                           kind="server_error", code="loading")
        return state.engine

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.engine.dead:
            return JSONResponse({"status": "dead", "reason": state.engine.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        llm = engine().llm
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "afserve", "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        eng = engine()
        _check_request(state, body)
        prompts = [_ids(eng.llm, p, "prompt") for p in body.prompts()]
        params = _params(eng.llm, body, body.max_tokens if body.max_tokens is not None else 16, prompts)
        return await _respond(state, eng, body, request, prompts, params, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        eng = engine()
        _check_request(state, body)
        tok = eng.llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, f"model {state.model_name!r} has no tokenizer chat template; use /v1/completions")
        try:
            text = tok.apply_chat_template(body.conversation(), add_generation_prompt=body.add_generation_prompt,
                                           tokenize=False)
        except Exception as e:   # a template may reject a conversation (roles, order): the client's to fix
            raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from e
        ids = tok.encode(text, add_special_tokens=False)
        prompts = [_ids(eng.llm, ids, "messages")]
        limit = body.limit()
        room = min(eng.llm.max_model_len, eng.llm.kv_capacity_tokens) - len(ids)   # the default: all that fits
        params = _params(eng.llm, body, limit if limit is not None else max(1, room), prompts)
        return await _respond(state, eng, body, request, prompts, params, chat=True)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await _scrape(state), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def attach(app: FastAPI, llm, timeout_s: float = 60.0) -> EngineClient:
    """Connect the running app (its server has started) to a ready engine; call from any thread."""
    state: _ServerState = app.state.afserve
    if not state.loop_ready.wait(timeout_s):
        raise RuntimeError(f"the HTTP server did not start within {timeout_s} s")
    client = EngineClient(llm, state.metrics)
    client.start(state.loop)
    state.engine = client
    return client


def shut_down(app: FastAPI, why: str) -> None:
    """The engine is stopping: fail what is still open with a 503 so no handler waits forever."""
    state: _ServerState = app.state.afserve
    if state.engine is not None and not state.engine.dead:
        state.engine.close()
        state.engine.fail(why)


# ----- request handling ----------------------------------------------------------------------------------------
def _short(value, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_request(state: _ServerState, body) -> None:
    if body.model not in (state.model_name, state.model_path):
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r} "
                            f"(see /v1/models)", "model", "model_not_found")
    problems = body.unsupported()
    if problems:
        raise APIError(400, problems[0][1], problems[0][0], "unsupported_parameter")


def _ids(llm, prompt, param: str) -> list[int]:
    try:
        return llm.prompt_ids(prompt)
    except ValueError as e:
        raise APIError(400, str(e), param) from e


def _params(llm, body, max_tokens: int, prompts: list[list[int]]) -> SamplingParams:
    try:
        params = body.sampling_params(max_tokens)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    bad = [t for t in params.stop_token_ids if t >= llm.spec.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids has {bad[0]}, outside the vocabulary [0, {llm.spec.vocab_size})",
                       "stop_token_ids")
    for ids in prompts:
        try:
            llm.check_fits(ids, params)
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from e
    return params


async def _drive(eng: EngineClient, choices: dict[str, _Choice], sink: asyncio.Queue):
    """Yield (choice, new text) as tokens arrive until every choice has finished. Whatever is still running
    when this ends early (client gone, cancelled, error) is aborted."""
    open_ = set(choices)
    try:
        while open_:
            rid, toks, finish = await sink.get()
            if rid not in open_:
                continue
            if toks is None:     # the engine went down
                raise _engine_down(finish)
            c = choices[rid]
            c.num_tokens += len(toks)
            piece = c.stream.add(toks, final=finish is not None)
            if c.stream.stopped and finish is None:
                eng.release(rid, "stop")
                finish = "stop"
            if finish is not None:
                c.finish = "stop" if finish == "abort" else finish
                open_.discard(rid)
            yield c, piece
    finally:
        for rid in open_:
            eng.release(rid, "abort")


async def _respond(state: _ServerState, eng: EngineClient, body, request: Request, prompts: list[list[int]],
                   params: SamplingParams, chat: bool):
    stops = body.stop_strings()
    sink: asyncio.Queue = asyncio.Queue()
    choices: dict[str, _Choice] = {}
    try:
        for i, ids in enumerate(prompts):
            rid = eng.submit(ids, params, sink)
            choices[rid] = _Choice(i, len(ids), TextStream(eng.llm.tokenizer, stops))
    except BaseException:
        for rid in choices:      # a batch is all or nothing
            eng.release(rid, "abort")
        raise
    rid_prefix = "chatcmpl-" if chat else "cmpl-"
    resp_id, created = rid_prefix + uuid.uuid4().hex, int(time.time())

    def usage() -> dict:
        p, c = sum(ch.prompt_len for ch in choices.values()), sum(ch.num_tokens for ch in choices.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_list: list, with_usage: bool = False) -> str:
            d = {"id": resp_id, "object": obj, "created": created, "model": state.model_name, "choices": choice_list}
            if with_usage:
                d["usage"] = usage()
            return f"data: {json.dumps(d)}\n\n"

        async def events():
            try:
                if chat:
                    for c in choices.values():
                        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                async for c, piece in _drive(eng, choices, sink):
                    if not piece and c.finish is None:
                        continue
                    if chat:
                        delta = {"content": piece} if piece else {}
                        yield chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": c.finish}])
                    else:
                        yield chunk([{"index": c.index, "text": piece, "logprobs": None, "finish_reason": c.finish}])
                if include_usage:
                    yield chunk([], with_usage=True)
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect():
        async for c, piece in _drive(eng, choices, sink):
            c.text.append(piece)

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()      # _drive's cleanup aborts what still runs
                await asyncio.gather(task, return_exceptions=True)
                return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
        task.result()
    finally:
        if not task.done():
            task.cancel()
    ordered = sorted(choices.values(), key=lambda c: c.index)
    if chat:
        out = [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)}, "logprobs": None,
                "finish_reason": c.finish} for c in ordered]
        obj = "chat.completion"
    else:
        out = [{"index": c.index, "text": "".join(c.text), "logprobs": None, "finish_reason": c.finish}
               for c in ordered]
        obj = "text_completion"
    return {"id": resp_id, "object": obj, "created": created, "model": state.model_name, "choices": out,
            "usage": usage()}


# ----- metrics -------------------------------------------------------------------------------------------------
class _EngineSeries:
    """The engine-side series of one scrape: queue sizes and KV blocks per attention rank (leader stats), and
    per-layer dispatch/combine totals per rank plus expert-rank balance (comm stats)."""

    def __init__(self, stats: dict, comm: dict):
        self.stats, self.comm = stats, comm

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("afserve_requests_running", "Requests in the running batch", value=s["num_running"])
        yield GaugeMetricFamily("afserve_requests_waiting", "Requests waiting for admission",
                                value=s["num_waiting"])
        total = GaugeMetricFamily("afserve_kv_blocks_total", "KV blocks in the pool", labels=["rank"])
        used = GaugeMetricFamily("afserve_kv_blocks_used", "KV blocks in use", labels=["rank"])
        ratio = GaugeMetricFamily("afserve_kv_cache_usage_ratio", "Share of KV blocks in use", labels=["rank"])
        for r, (free, n) in enumerate(zip(s["free_kv_blocks"], s["kv_blocks"])):
            total.add_metric([str(r)], n)
            used.add_metric([str(r)], n - free)
            ratio.add_metric([str(r)], (n - free) / n if n else 0.0)
        yield from (total, used, ratio)
        yield CounterMetricFamily("afserve_engine_steps", "Engine steps", value=s["steps"])
        yield CounterMetricFamily("afserve_preemptions", "Preempted requests", value=s["num_preemptions"])
        secs = CounterMetricFamily("afserve_layer_comm_seconds", "Wall time in dispatch/combine per layer",
                                   labels=["rank", "role", "layer", "phase"])
        sent = CounterMetricFamily("afserve_layer_comm_bytes_sent", "Bytes sent in dispatch/combine per layer",
                                   labels=["rank", "role", "layer", "phase"])
        calls = CounterMetricFamily("afserve_layer_comm_calls", "Dispatch/combine calls per layer",
                                    labels=["rank", "role", "layer", "phase"])
        for rank, r in self.comm.get("ranks", {}).items():
            for layer, phases in r["layers"].items():
                for phase, v in phases.items():
                    labels = [rank, r["role"], layer, phase]
                    secs.add_metric(labels, v["time_s"])
                    sent.add_metric(labels, v["bytes_sent"])
                    calls.add_metric(labels, v["calls"])
        yield from (secs, sent, calls)
        balance = GaugeMetricFamily("afserve_expert_load_max_mean",
                                    "Max over mean expert-rank load per layer (recent steps)", labels=["layer"])
        for layer, v in self.comm.get("expert_load", {}).get("layers", {}).items():
            balance.add_metric([layer], v["max_mean"])
        yield balance


async def _scrape(state: _ServerState) -> str:
    text = generate_latest(state.metrics.registry).decode()
    eng = state.engine
    if eng is None or eng.dead:
        return text
    async with state.scrape_lock:
        stats = await eng.query("stats")
        comm = await eng.query("comm_stats")
    reg = CollectorRegistry()
    reg.register(_EngineSeries(stats, comm))
    return text + generate_latest(reg).decode()

