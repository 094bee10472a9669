"""Completions and chat completions over the engine: request checks, the engine's parameters, and the answer
(one JSON body, or SSE chunks as text arrives). Stop strings, detokenisation, echo and the logprobs' shapes
happen here; the engine sees token ids. A request whose client goes away (stream closed or connection dropped)
is aborted, which frees its KV blocks.

Streamed logprobs stay beside their text: a chunk carries the logprobs of the tokens whose text is wholly in
the text sent so far, so a token held back (it may start a stop string, or ends in part of a character) comes
with the chunk that sends its text. The last chunk carries every token left, also those a stop string cut
from the text (the engine generated them; `usage` counts them, as vLLM's does); their text_offset is the text's
end."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from attention_nodes.sampling_params import SamplingParams

from .http_access import access_record
from .http_engine import EngineClient, Progress, engine_down
from .http_logprobs import Position, TokenNames, chat_logprobs, completion_logprobs
from .http_text import TextStream, TokenSpans, prompt_text
from .protocol import APIError


def check_model(model: str | None, served: tuple[str, str]) -> None:
    """404 unless `model` names the served model (its name or its path); None (optional fields) passes."""
    if model is not None and model not in served:
        raise APIError(404, f"model {model!r} does not exist; this server serves {served[0]!r} (see /v1/models)",
                       "model", "model_not_found")


def check_request(body, served: tuple[str, str]) -> None:
    """404 for another model, 400 naming the first field set that this server does not implement."""
    check_model(body.model, served)
    problems = body.unsupported()
    if problems:
        raise APIError(400, problems[0][1], problems[0][0], "unsupported_parameter")


def sampling_params(llm, body, max_tokens: int, prompts: list[list[int]]) -> SamplingParams:
    """The engine's parameters for body; a 400 for bad values, token ids outside the vocabulary, or a prompt
    that does not fit with max_tokens."""
    params = body.sampling_params(max_tokens, llm.spec.vocab_size)
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


@dataclass(slots=True)
class _Echo:
    """A completion's prompt, sent first (echo), with its scores once the engine has sent them all."""

    text: str
    positions: list[Position]
    scores: list | None          # the prompt's logprob dicts so far (None: logprobs not asked for)
    is_sent: bool = False

    @classmethod
    def from_prompt(cls, tokenizer, prompt, ids: list[int], logprobs: bool) -> _Echo:
        text, skip_special = prompt_text(tokenizer, prompt, ids)
        positions = []
        if logprobs:
            spans = TokenSpans(tokenizer, skip_special)
            spans.add(ids)
            spans.close(len(text), complete=True)
            positions = [Position(t, None, at) for t, at in zip(ids, spans.starts(0, len(ids)))]
        return cls(text, positions, [] if logprobs else None)

    @property
    def is_ready(self) -> bool:
        return self.scores is None or len(self.scores) >= len(self.positions)

    def take(self) -> tuple[str, list[Position]]:
        for p, s in zip(self.positions, self.scores or []):
            p.scores = s
        self.is_sent = True
        return self.text, self.positions


@dataclass(slots=True)
class _Choice:
    index: int
    prompt_len: int
    stream: TextStream
    echo: _Echo | None = None
    scores: list | None = None         # generated tokens' logprob dicts (None: logprobs not asked for)
    num_reported: int = 0              # generated tokens whose logprobs were handed out
    num_tokens: int = 0
    finish: str | None = None
    text: list[str] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)

    def take_positions(self, scores: list | None) -> list[Position]:
        """The generated tokens now wholly in the text sent (all of them once finished), with their scores."""
        if self.scores is None:
            return []
        self.scores.extend(scores or [])
        hi = min(self.stream.num_sent_tokens, len(self.scores))
        base = len(self.echo.text) if self.echo is not None else 0
        starts = self.stream.spans.starts(self.num_reported, hi)
        out = [Position(self.stream.ids[i], self.scores[i], base + at)
               for i, at in zip(range(self.num_reported, hi), starts)]
        self.num_reported = hi
        return out


async def _drive(eng: EngineClient, choices: dict[str, _Choice], sink: asyncio.Queue):
    """Yield (choice, new text, its positions) as tokens arrive until every choice has finished; an echoed
    prompt comes first. Whatever is still running when this ends early (client gone, cancelled, error) is
    aborted."""
    open_ = set(choices)
    try:
        for c in choices.values():
            if c.echo is not None and c.echo.is_ready:
                yield (c, *c.echo.take())
        while open_:
            got: Progress = await sink.get()
            rid, toks, finish = got.request_id, got.token_ids, got.finish
            if rid not in open_:
                continue
            if toks is None:     # the engine went down
                raise engine_down(finish)
            c = choices[rid]
            if c.echo is not None and not c.echo.is_sent:
                c.echo.scores.extend(got.prompt_logprobs or [])
                if c.echo.is_ready or finish is not None:
                    yield (c, *c.echo.take())
            c.num_tokens += len(toks)
            piece = c.stream.add(toks, final=finish is not None)
            if c.stream.stopped and finish is None:
                eng.release(rid, "stop")
                finish = "stop"
            if finish is not None:
                c.finish = "stop" if finish == "abort" else finish
                open_.discard(rid)
            yield c, piece, c.take_positions(got.logprobs)
    finally:
        for rid in open_:
            eng.release(rid, "abort")


async def respond(model_name: str, eng: EngineClient, body, request: Request, prompts: list[list[int]],
                  params: SamplingParams, chat: bool, echo: list | None = None):
    """Submit every prompt (one choice each) and answer as body asks: streamed or one JSON body. echo: the
    prompts as sent (strings or ids), to return first (completions)."""
    stops = body.stop_strings()
    sink: asyncio.Queue = asyncio.Queue()
    choices: dict[str, _Choice] = {}
    tok = eng.llm.tokenizer
    has_logprobs = params.logprobs is not None
    try:
        for i, ids in enumerate(prompts):
            rid = eng.submit(ids, params, sink)
            choices[rid] = _Choice(i, len(ids), TextStream(tok, stops, spans=has_logprobs),
                                   echo=None if echo is None else _Echo.from_prompt(tok, echo[i], ids, has_logprobs),
                                   scores=[] if has_logprobs else None)
    except BaseException:
        for rid in choices:      # a batch is all or nothing
            eng.release(rid, "abort")
        raise
    rid_prefix = "chatcmpl-" if chat else "cmpl-"
    resp_id, created = rid_prefix + uuid.uuid4().hex, int(time.time())
    names = TokenNames(tok)

    def logprobs(positions: list[Position]) -> dict | None:
        if not has_logprobs:
            return None
        return chat_logprobs(names, positions, params.logprobs) if chat else completion_logprobs(names, positions)

    def usage(of: list[_Choice] | None = None) -> dict:
        of = list(choices.values()) if of is None else of
        p, c = sum(ch.prompt_len for ch in of), sum(ch.num_tokens for ch in of)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    access = access_record(request)
    access.usage = usage
    if body.stream:
        opts = body.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = opts is not None and opts.continuous_usage_stats
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_list: list, usage_of: list[_Choice] | None = None) -> str:
            """usage_of: the choices whose usage so far the chunk carries (None: no usage)."""
            d = {"id": resp_id, "object": obj, "created": created, "model": model_name, "choices": choice_list}
            if usage_of is not None:
                d["usage"] = usage(usage_of)
            return f"data: {json.dumps(d)}\n\n"

        async def events():
            try:
                if chat:
                    for c in choices.values():
                        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}], [c] if continuous else None)
                async for c, piece, positions in _drive(eng, choices, sink):
                    if not piece and not positions and c.finish is None:
                        continue
                    if chat:
                        part = {"index": c.index, "delta": {"content": piece} if piece else {}}
                    else:
                        part = {"index": c.index, "text": piece}
                    part.update(logprobs=logprobs(positions), finish_reason=c.finish)
                    yield chunk([part], [c] if continuous else None)   # usage per choice, as vLLM
                if include_usage:
                    yield chunk([], list(choices.values()))
            except APIError as e:
                access.error = e.message
                yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect():
        async for c, piece, positions in _drive(eng, choices, sink):
            c.text.append(piece)
            c.positions += positions

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()      # _drive's cleanup aborts what still runs
                await asyncio.gather(task, return_exceptions=True)
                access.error = "client disconnected"
                return JSONResponse(APIError(499, access.error).body(), status_code=499)
        task.result()
    finally:
        if not task.done():
            task.cancel()
    ordered = sorted(choices.values(), key=lambda c: c.index)
    if chat:
        out = [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": logprobs(c.positions), "finish_reason": c.finish} for c in ordered]
        obj = "chat.completion"
    else:
        out = [{"index": c.index, "text": "".join(c.text), "logprobs": logprobs(c.positions),
                "finish_reason": c.finish} for c in ordered]
        obj = "text_completion"
    return {"id": resp_id, "object": obj, "created": created, "model": model_name, "choices": out,
            "usage": usage()}
