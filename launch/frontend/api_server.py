"""The OpenAI-compatible HTTP front: FastAPI app over an `LLM` whose leader runs in this process (torchrun,
attention rank 0) or in a spawned rank (a plain process).

This module owns the app: its routes, error handlers and API-key check, and `attach`/`shut_down`, which
connect it to an engine and disconnect it. The parts live beside it:
  engine_client.py  `EngineClient`: the LLM's inbox/outbox <-> asyncio handlers (router thread)
  generate.py       completions and chat completions: checks, sampling parameters, n and best_of, echo, JSON
                    and SSE answers; beam.py their use_beam_search
  logprobs.py       logprobs in OpenAI's completions and chat shapes
  tokens.py         prompts and chats -> token ids; /tokenize and /detokenize
  text.py           `TextStream`: incremental detokenisation, stop strings, where each token's text sits
  metrics.py        `Metrics` and the /metrics scrape
  access_log.py     the access log (one line per request)
  protocol.py       request shapes and `APIError`; chat.py the chat completions' shapes, tools among them
  answer.py         a chat answer: reasoning (reasoning.py, --reasoning-parser), content, tool calls
  tools.py          tool calls in chat answers (named, required, auto through a parser; tool_parsers.py, and
                    harmony.py for GPT-OSS)
  responses.py      /v1/responses: the Responses API as a chat completion, its answer reshaped (its events:
                    response_events.py)
  response_store.py the responses kept for GET /v1/responses/{id} and previous_response_id
  messages.py       /v1/messages: Anthropic's Messages API as a chat completion (its events: message_events.py)
Request fields no model in protocol.py or chat.py defines are ignored, with one warning per request naming them.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..admission import sampling_defaults
from . import beam
from . import messages as messages_api
from .access_log import ACCESS_LOGGER, AccessLog, access_record
from .answer import ChatAnswer, check_parsers, require_tokens
from .chat import ChatCompletionRequest
from .engine_client import EngineClient
from .generate import check_model, check_request, respond, sampling_params
from .harmony import HarmonyAnswer
from .message_events import MessageEvents
from .messages import MessagesRequest
from .metrics import Metrics, scrape
from .middleware import ApiKey, route_path
from .protocol import APIError, CompletionRequest, DrainRequest
from .reasoning import PARSERS as REASONING_PARSERS
from .reasoning import ReasoningPlan
from .response_events import Events, translate
from .response_store import DEFAULT_CAPACITY, ResponseStore
from .responses import ResponsesRequest, field_of
from .responses import answer as responses_answer
from .text import TextStream
from .tokens import DetokenizeRequest, TokenizeRequest, chat_text, detokenize, prompt_ids, tokenize, was_cut
from .tool_parsers import NAMES as TOOL_PARSERS
from .tools import ToolPlan


def _version() -> str:
    """afserve's version: the installed package's, else (a source tree run as it is) its pyproject.toml's."""
    try:
        return importlib.metadata.version("afserve")
    except importlib.metadata.PackageNotFoundError:
        import tomllib
        with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
            return tomllib.load(f)["project"]["version"]


VERSION = _version()

__all__ = ["EngineClient", "Metrics", "TextStream", "attach", "build_app", "shut_down"]

logger = logging.getLogger("afserve.http")


class _ServerState:
    def __init__(self, model_name: str, model_path: str, responses_store: int = DEFAULT_CAPACITY,
                 prompt_tokens_details: bool = False):
        self.model_name, self.model_path = model_name, model_path
        self.prompt_tokens_details = prompt_tokens_details     # usage's cached_tokens (chat, completions, messages)
        self.engine: EngineClient | None = None
        self.metrics = Metrics()
        self.created = int(time.time())
        self.scrape_lock = asyncio.Lock()       # one stats collective at a time
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_ready = threading.Event()
        self.tool_parser: str | None = None
        self.reasoning_parser: str | None = None
        self.responses = ResponseStore(responses_store)     # /v1/responses kept for GET and previous_response_id

    @property
    def served(self) -> tuple[str, str]:
        """The names a request's `model` may give: the served name and the checkpoint path."""
        return self.model_name, self.model_path


def build_app(model_name: str, model_path: str, api_key: str | None = None, access_log: bool = True,
              tool_parser: str | None = None, reasoning_parser: str | None = None,
              responses_store: int = DEFAULT_CAPACITY, prompt_tokens_details: bool = False,
              stream_interval: int = 1) -> FastAPI:
    """The app; `attach(app, llm)` connects it to an engine once every rank is ready (until then /health and
    the API answer 503). With `access_log`, one INFO line per request goes to logger "afserve.http.access";
    that logger is set to INFO unless its level was set already (serve.py's root logger says WARNING).
    tool_parser: how tool_choice "auto" finds calls in the output (launch/frontend/tool_parsers.py NAMES; None:
    auto is refused, serve.py's --enable-auto-tool-choice is off); reasoning_parser: how chat answers split off
    their reasoning (launch/frontend/reasoning.py PARSERS; None: they do not); responses_store: how many
    /v1/responses responses are kept for GET and previous_response_id (launch/frontend/response_store.py; 0:
    none); prompt_tokens_details: chat, completions and Anthropic messages report the prompt tokens found in the
    prefix cache in usage (vLLM's --enable-prompt-tokens-details; /v1/responses always does, as vLLM's);
    stream_interval: the fewest new tokens a streamed chunk carries (`EngineClient`; vLLM's --stream-interval)."""
    if api_key == "":     # it would match a missing x-api-key header
        raise ValueError("api_key is empty: pass a key, or leave it out to serve without one")
    if tool_parser is not None and tool_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_parser={tool_parser!r} is unknown; pass one of {', '.join(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={reasoning_parser!r} is unknown; pass one of "
                         f"{', '.join(REASONING_PARSERS)}")
    check_parsers(tool_parser, reasoning_parser)
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval={stream_interval!r} is invalid: pass a number of tokens >= 1")
    state = _ServerState(model_name, model_path, responses_store, prompt_tokens_details)
    state.stream_interval = stream_interval
    state.tool_parser, state.reasoning_parser = tool_parser, reasoning_parser

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.loop_ready.set()
        yield
        if state.engine is not None:
            state.engine.close()

    app = FastAPI(title="afserve", description="OpenAI-compatible API of an attention/FFN-disaggregated MoE runtime",
                  version=VERSION, lifespan=lifespan)
    app.state.afserve = state
    _add_error_handlers(app)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)     # inside AccessLog, so a refused request is logged too
    if access_log:
        app.add_middleware(AccessLog)
        access = logging.getLogger(ACCESS_LOGGER)
        if access.level == logging.NOTSET:
            access.setLevel(logging.INFO)

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

    app.add_api_route("/ping", health, methods=["GET", "POST"])     # vLLM's (SageMaker's health check)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        llm = engine().llm
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "afserve", "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _warn_ignored(body, request)
        check_request(body, state.served)
        eng = engine()
        keep = body.truncation(eng.llm.max_model_len)
        sent = body.prompts()
        prompts = [prompt_ids(eng.llm, p, "prompt", body.add_special_tokens, keep) for p in sent]
        if body.use_beam_search:
            beam.check(body)
            params = await sampling_params(eng.llm, beam.sampled(body), body.limit(), prompts)
            return await beam.answer(state.model_name, eng, body, request, prompts, params, chat=False)
        params = await sampling_params(eng.llm, body, body.limit(), prompts)
        if (reasoning := ReasoningPlan.of(body, reasoning_parser, eng.llm.tokenizer)) is not None:
            params = reasoning.gated(params, prompts)     # structured outputs bind once a prompt's thinking ended
        echo = None
        if body.echo:   # a prompt that truncate_prompt_tokens cut is echoed as the tokens the model saw
            echo = [ids if keep and was_cut(eng.llm.tokenizer, p, ids, body.add_special_tokens) else p
                    for p, ids in zip(sent, prompts)]
        return await respond(state.model_name, eng, body, request, prompts, params, chat=False, echo=echo,
                             cached_details=state.prompt_tokens_details)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _warn_ignored(body, request)
        return await chat(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        _warn_ignored(body, request)
        check_model(body.model, state.served)
        if (refused := body.refused()) is not None:
            raise APIError(400, refused[1], refused[0], "unsupported_parameter")
        store = state.responses
        previous = store.conversation(body.previous_response_id) if body.previous_response_id is not None else []
        body.store = body.store and store.enabled       # answered false where none is kept (vLLM's)
        kept = body.messages(previous)

        def done(response: dict) -> dict:
            if body.store:
                store.put(response, kept)
            return response
        try:
            answer = await chat(body.chat(kept), request, cached_details=True)
        except APIError as e:       # name the field the client sent
            e.param = field_of(e.param)
            raise
        except ValidationError as e:
            err = _chat_invalid(e)
            err.param = field_of(err.param)
            raise err from e
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(translate(answer.body_iterator, Events(body, state.model_name, done)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not isinstance(answer, dict):    # an error answer (the client left, say)
            return answer
        return done(responses_answer(body, state.model_name, answer))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return state.responses.response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return state.responses.delete(response_id)

    @app.post("/v1/messages")
    async def anthropic_messages(body: MessagesRequest, request: Request):
        _warn_ignored(body, request)
        check_model(body.model, state.served)
        answer = await chat(anthropic_chat(body), request)
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(translate(answer.body_iterator, MessageEvents(state.model_name)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not isinstance(answer, dict):    # an error answer (the client left, say)
            return answer
        return messages_api.answer(state.model_name, answer)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: MessagesRequest, request: Request):
        _warn_ignored(body, request)
        check_model(body.model, state.served)
        chat_body = anthropic_chat(body, counting=True)
        check_request(chat_body, state.served)
        return {"input_tokens": len(chat_prompt(engine(), chat_body))}

    def anthropic_chat(body: MessagesRequest, counting: bool = False) -> ChatCompletionRequest:
        try:
            return body.chat(counting)
        except ValidationError as e:
            raise _chat_invalid(e) from e

    def chat_prompt(eng: EngineClient, body: ChatCompletionRequest) -> list[int]:
        """A chat's prompt token ids: its template rendered, tokenized, truncated as it asks."""
        text = chat_text(eng.llm.tokenizer, body, state.model_name, body.continue_final_message)
        return prompt_ids(eng.llm, text, "messages", body.add_special_tokens, body.truncation(eng.llm.max_model_len))

    async def chat(body: ChatCompletionRequest, request: Request, cached_details: bool | None = None):
        check_request(body, state.served)
        tools = ToolPlan.of(body, tool_parser)
        eng = engine()
        tok = eng.llm.tokenizer
        reasoning = ReasoningPlan.of(body, reasoning_parser, tok)
        prompts = [chat_prompt(eng, body)]
        answer = HarmonyAnswer.of(body, tools, reasoning_parser, tool_parser, tok) or ChatAnswer.of(tools, reasoning)
        if body.use_beam_search:
            beam.check(body)
            params = await sampling_params(eng.llm, beam.sampled(body), body.limit(), prompts)
            return await beam.answer(state.model_name, eng, body, request, prompts, params, chat=True, shape=answer)
        params = await sampling_params(eng.llm, body, body.limit(), prompts)
        if reasoning is not None:
            params = reasoning.gated(params, prompts)     # the grammar binds once the thinking has ended
        return await respond(state.model_name, eng, body, request, prompts, params, chat=True, answer=answer,
                             cached_details=state.prompt_tokens_details if cached_details is None else cached_details)

    @app.post("/tokenize")
    async def tokenize_(body: TokenizeRequest, request: Request):
        _warn_ignored(body, request)
        check_model(body.model, state.served)
        eng = engine()
        return tokenize(eng.llm, body, state.model_name)

    @app.post("/detokenize")
    async def detokenize_(body: DetokenizeRequest, request: Request):
        _warn_ignored(body, request)
        check_model(body.model, state.served)
        eng = engine()
        return detokenize(eng.llm, body, state.model_name)

    @app.post("/admin/drain")
    async def drain(body: DrainRequest, request: Request):
        """Remove the given ranks between steps (launch/runtime/membership.py); answers the membership change."""
        _warn_ignored(body, request)
        body.check()
        eng = engine()
        ask = {"retire": body.ranks} if body.ranks is not None else {"retire_hosts": body.hosts}
        record = await eng.query("scale", ask, timeout_s=eng.llm.config.startup_timeout_s)
        if "error" in record:
            raise APIError(400, record["error"], "ranks" if body.ranks is not None else "hosts")
        return record

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        """vLLM's (its dev mode): every attention rank forgets its prefix cache between steps -> {"success": true}
        (running requests never make it fail here: reset_running_requests has nothing to do)."""
        if reset_external:
            raise APIError(400, "reset_external=true: this engine has no KV connector; leave it out",
                           "reset_external")
        return {"success": bool(await engine().query("reset_prefix_cache"))}

    @app.get("/metrics")
    async def metrics():
        text = await scrape(state.metrics, state.engine, state.scrape_lock)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is answered in OpenAI's {"error": {...}} shape (Anthropic's on /v1/messages); its message goes to
    the access log."""

    def answer(request: Request, err: APIError, headers: dict | None = None) -> JSONResponse:
        access_record(request).error = err.message
        body = messages_api.error_body(err) if route_path(request.scope).startswith("/v1/messages") else err.body()
        return JSONResponse(body, status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
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
        return answer(request, APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return answer(request, APIError(exc.status_code, str(exc.detail), kind=kind), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return answer(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))


def _chat_invalid(e: ValidationError) -> APIError:
    """A 400 naming the chat field a converted request (Responses, Messages) got wrong."""
    first = e.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ())) or None
    return APIError(400, f"the request does not make a chat completion: {where}: {first['msg']}", where)


def _warn_ignored(body, request: Request) -> None:
    """One warning per request naming the fields it sent that this server ignores (vLLM's wording)."""
    ignored = body.ignored_fields()
    if ignored:
        logger.warning("The following fields were present in the request but ignored: {%s} (%s %s)",
                       ", ".join(repr(f) for f in sorted(ignored)), request.method, request.url.path)


def _short(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, str) else repr(value)
    except (TypeError, ValueError):      # not a JSON value: a body sent without a JSON content type arrives as bytes
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def attach(app: FastAPI, llm, timeout_s: float = 60.0) -> EngineClient:
    """Connect the running app (its server has started) to a ready engine; call from any thread."""
    state: _ServerState = app.state.afserve
    if not state.loop_ready.wait(timeout_s):
        raise RuntimeError(f"the HTTP server did not start within {timeout_s} s")
    sampling_defaults(llm.config)    # read once now: a malformed generation_config.json fails the start
    require_tokens(llm.tokenizer, state.tool_parser, state.reasoning_parser, llm.config.model)
    client = EngineClient(llm, state.metrics, state.stream_interval)
    client.start(state.loop)
    state.engine = client
    return client


def shut_down(app: FastAPI, why: str) -> None:
    """The engine is stopping: fail what is still open with a 503 so no handler waits forever."""
    state: _ServerState = app.state.afserve
    if state.engine is not None and not state.engine.dead:
        state.engine.close()
        state.engine.fail(why)
