"""Completions and chat completions over the engine: request checks, the engine's parameters, and the answer
(one JSON body, or SSE chunks as text arrives). Stop strings, detokenisation, echo and the logprobs' shapes
happen here; the engine sees token ids. A request whose client goes away (stream closed or connection dropped)
is aborted, every sample of it, which frees its KV blocks.

n and best_of: each prompt is one engine request drawing num_samples samples, each reported under its own id
(launch/samples.py); the n choices of prompt p have indexes p * n + sample index, or with best_of > n (not
streamed) p * n + rank among the samples by summed logprob. Stop strings apply per sample. An echoed prompt's
logprobs come with sample 0 only, and every choice of the prompt shows them. With max_tokens 0 the engine draws
nothing: one engine sample fills all n choices (echo, or prompt_logprobs). prompt_logprobs (vLLM's, not streamed)
shows the same scores as echo's logprobs, in vLLM's shape with each token's rank.

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

from ..admission import sampling_defaults
from ..samples import Sample, chosen, sample_ids, stop_reason_ids
from .access_log import access_record
from .answer import ChatAnswer, ChatAnswerStream
from .engine_client import EngineClient, Progress, engine_down
from .logprobs import Position, TokenNames, chat_logprobs, completion_logprobs, prompt_logprobs, top_entries
from .protocol import APIError, param_of
from .text import TextStream, TokenSpans, prompt_text
from .tokens import bad_words_ids


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


async def sampling_params(llm, body, max_tokens: int | None, prompts: list[list[int]]) -> list[SamplingParams]:
    """The engine's parameters for body, one per prompt. max_tokens None: all the room the prompt leaves in
    max_model_len and one rank's KV cache (vLLM's default for a null max_tokens). A 400 for bad values, token
    ids outside the vocabulary, a prompt that does not fit with max_tokens, or structured outputs that do not
    compile: they compile on a worker thread (xgrammar releases the GIL), so the front serves other requests
    meanwhile (the ranks compile them again, also off their steps)."""
    room = min(llm.max_model_len, llm.kv_capacity_tokens)
    bad_words = bad_words_ids(llm.tokenizer, body.bad_words)
    made: dict[int, SamplingParams] = {}
    out = []
    for ids in prompts:
        if max_tokens is None and len(ids) >= room:
            raise APIError(400, f"the prompt has {len(ids)} tokens, which leaves no room for a completion within "
                                f"this model's context of {room} tokens (max_model_len and one rank's KV cache); "
                                f"shorten the prompt", "messages" if hasattr(body, "messages") else "prompt",
                           "context_length_exceeded")
        limit = room - len(ids) if max_tokens is None else max_tokens
        if limit not in made:
            made[limit] = params = body.sampling_params(limit, llm.spec.vocab_size,
                                                        sampling_defaults(llm.config), bad_words)
            bad = [t for t in params.stop_token_ids if t >= llm.spec.vocab_size]
            if bad:
                raise APIError(400, f"stop_token_ids has {bad[0]}, outside the vocabulary [0, "
                                    f"{llm.spec.vocab_size})", "stop_token_ids")
            try:
                llm.admission.check_samples(params)
            except ValueError as e:
                raise APIError(400, str(e), "best_of" if params.best_of is not None else "n") from e
            try:
                llm.admission.check_priority(params)
            except ValueError as e:
                raise APIError(400, str(e), "priority") from e
            try:
                llm.admission.check_tokens(params)
            except ValueError as e:
                raise APIError(400, str(e), param_of(e)) from e
        try:
            llm.admission.check_fits(ids, made[limit])   # the rest of `check` ran once per parameters, above
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from e
        out.append(made[limit])
    for params in made.values():
        if params.structured_outputs is not None:
            try:
                await asyncio.to_thread(llm.admission.check_structured, params)
            except ValueError as e:
                raise APIError(400, str(e), body.structured()[1]) from e
    return out


@dataclass(slots=True)
class _Echo:
    """A completion's prompt, which each of its choices sends first (echo), with its scores once the engine has
    sent them all. One per prompt: the scores come with sample 0's progress only, and every choice shows them."""

    text: str
    positions: list[Position]
    scores: list | None          # the prompt's scores so far, (entry, rank) (None: logprobs not asked for)
    top: int = 0                 # the alternatives its logprobs show (the engine may have sent more)

    @classmethod
    def from_prompt(cls, tokenizer, prompt, ids: list[int], scores: list | None, top: int) -> _Echo:
        """scores: the prompt's list of engine scores, shared with its choices (None: logprobs not asked for)."""
        text, skip_special = prompt_text(tokenizer, prompt, ids)
        positions = []
        if scores is not None:
            spans = TokenSpans(tokenizer, skip_special)
            spans.add(ids)
            spans.close(len(text), complete=True)
            positions = [Position(t, None, at) for t, at in zip(ids, spans.starts(0, len(ids)))]
        return cls(text, positions, scores, top)

    @property
    def is_ready(self) -> bool:
        return self.scores is None or len(self.scores) >= len(self.positions)

    def take(self) -> tuple[str, list[Position]]:
        for p, s in zip(self.positions, self.scores or []):
            p.scores = s and top_entries(s[0], p.token_id, self.top)
        return self.text, self.positions


@dataclass(slots=True)
class _Choice:
    """One sample of one prompt. index: prompt index * n + sample index; with best_of > n, prompt index * n +
    rank among the prompt's samples, set once all have finished."""

    index: int
    prompt_index: int
    request_id: str                    # the engine request that draws it
    prompt_len: int
    stream: TextStream
    sample: Sample                     # its tokens and summed logprob, to rank by (best_of)
    echo: _Echo | None = None
    is_echoed: bool = False
    prompt_scores: list | None = None      # the prompt's (entry, rank) per token, shared by its choices (None: none)
    num_ids_sent: int = -1                 # streamed with return_token_ids: its token ids sent (-1: no chunk yet)
    shape: ChatAnswerStream | None = None  # a streamed chat choice's reasoning and tool calls (None: plain text)
    scores: list | None = None         # generated tokens' logprob dicts (None: logprobs not asked for)
    num_reported: int = 0              # generated tokens whose logprobs were handed out
    num_tokens: int = 0
    finish: str | None = None
    stop_reason: str | int | None = None   # vLLM's: the stop string or stop token id that ended it (None: EOS, length)
    stop_ids: frozenset = frozenset()      # the request's stop_token_ids
    cached: int | None = None              # its prompt's tokens the engine found cached (None: not known yet)
    text: list[str] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)

    def take_echo(self) -> tuple[str, list[Position]]:
        self.is_echoed = True
        return self.echo.take()

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


async def _drive(eng: EngineClient, routes: dict[str, list[_Choice]], sink: asyncio.Queue):
    """Yield (choice, new text, its positions) as tokens arrive until every choice has finished; an echoed
    prompt comes first. routes: engine row id (a request's or one sample's) -> the choices it feeds (its own;
    with max_tokens 0, the one engine sample feeds each of the prompt's n choices). A stop string ends only
    its own sample. Whatever still runs when this ends early (client gone, cancelled, error) is aborted, every
    sample of it."""
    open_ = set(routes)
    try:
        for route in routes.values():
            for c in route:
                if c.echo is not None and c.echo.is_ready:
                    yield (c, *c.take_echo())
        while open_:
            got: Progress = await sink.get()
            row, toks, finish = got.request_id, got.token_ids, got.finish
            if row not in open_:
                continue
            if toks is None:     # the engine went down
                raise engine_down(finish)
            route = routes[row]
            if route[0].prompt_scores is not None:
                route[0].prompt_scores.extend(got.prompt_logprobs or [])
            is_stopped = False
            for c in route:
                # The prompt is scored in full before any sample is drawn, and sample 0's row comes first.
                if c.echo is not None and not c.is_echoed and (c.echo.is_ready or finish is not None):
                    yield (c, *c.take_echo())
                c.num_tokens += len(toks)
                c.sample.add(toks, got.logprobs, finish)
                c.cached = got.num_cached_tokens if c.cached is None else c.cached     # the first admission's
                piece = c.stream.add(toks, final=finish is not None,
                                     hide_last=bool(toks) and finish == "stop" and not c.stream.include_stop)
                stopped = c.stream.stopped and finish is None      # still running in the engine: release it
                is_stopped |= stopped
                ended = "stop" if c.stream.stopped else finish     # a stop string ends it, whatever the engine says
                if ended is not None:
                    c.finish = "stop" if ended == "abort" else ended
                    last = c.stream.ids[-1] if c.stream.ids else None
                    c.stop_reason = c.stream.stop_reason if c.stream.stopped else \
                        last if ended == "stop" and last in c.stop_ids else None
                yield c, piece, c.take_positions(got.logprobs)
            if is_stopped:
                eng.release(row, "stop")
            elif finish is not None:
                # the metrics count how the client sees it end (a stop string in the last tokens: "stop")
                eng.finished(row, finish if finish == "abort" else route[0].finish)
            if finish is not None or is_stopped:
                open_.discard(row)
    finally:
        for rid in dict.fromkeys(routes[row][0].request_id for row in open_):
            eng.release(rid, "abort")


def _best(choices: list[_Choice], params: SamplingParams, n: int) -> list[_Choice]:
    """With best_of > n: each prompt's n samples with the highest summed logprob, best first, indexed so (the
    ranking `LLM.generate` uses); else every choice, in index order."""
    if params.num_samples == params.n:
        return sorted(choices, key=lambda c: c.index)
    out = []
    for p in sorted({c.prompt_index for c in choices}):
        mine = {c.sample.index: c for c in choices if c.prompt_index == p}
        for rank, s in enumerate(chosen([c.sample for c in mine.values()], params)):
            mine[s.index].index = p * n + rank
            out.append(mine[s.index])
    return out


async def respond(model_name: str, eng: EngineClient, body, request: Request, prompts: list[list[int]],
                  per_prompt: list[SamplingParams], chat: bool, echo: list | None = None,
                  answer: ChatAnswer | None = None, cached_details: bool = False):
    """Submit every prompt (n choices each: one per sample, or with best_of the best n samples) and answer as
    body asks: streamed or one JSON body. per_prompt: each prompt's parameters (they differ in max_tokens at
    most); echo: the prompts as sent (strings or ids), to return first (completions); answer: how a chat's
    answer shows reasoning and tool calls (launch/frontend/answer.py; None: its text is the content);
    cached_details: usage carries prompt_tokens_details.cached_tokens, the prompt tokens the engine found in its
    prefix cache (vLLM's --enable-prompt-tokens-details), once the engine has said."""
    params = per_prompt[0]
    stops = body.stop_strings()
    n = body.n
    sink: asyncio.Queue = asyncio.Queue()
    choices: list[_Choice] = []
    routes: dict[str, list[_Choice]] = {}
    submitted: list[str] = []
    tok = eng.llm.tokenizer
    has_logprobs = params.logprobs is not None
    prompt_k = body.prompt_logprobs     # vLLM's prompt_logprobs answer (the engine's k may be larger: echo)
    stop_ids = stop_reason_ids(params, eng.llm.spec.eos_token_ids, tok)     # vLLM's stop_reason ids
    skip_special = body.skip_special_tokens and not (answer and answer.keeps_special_tokens)
    try:
        for p, ids in enumerate(prompts):
            rid = eng.submit(ids, per_prompt[p], sink)
            submitted.append(rid)
            scores = [] if params.prompt_logprobs is not None else None
            shown = None if echo is None else _Echo.from_prompt(tok, echo[p], ids, scores if has_logprobs else None,
                                                                 params.logprobs or 0)
            rows = sample_ids(rid, params.num_samples)
            mine = [_Choice(p * n + i, p, rid, len(ids), TextStream(tok, stops, has_logprobs, params.min_tokens,
                                                                     body.include_stop_str_in_output, skip_special),
                            Sample(i), echo=shown, scores=[] if has_logprobs else None, stop_ids=stop_ids,
                            prompt_scores=scores, shape=answer.stream() if answer and body.stream else None)
                    for i in range(max(n, len(rows)))]
            routes.update({rows[0]: mine} if len(rows) == 1 else {row: [c] for row, c in zip(rows, mine)})
            choices += mine
    except BaseException:
        for rid in submitted:      # a batch is all or nothing
            eng.release(rid, "abort")
        raise
    rid_prefix = "chatcmpl-" if chat else "cmpl-"
    resp_id, created = rid_prefix + uuid.uuid4().hex, int(time.time())
    names = TokenNames(None if body.return_tokens_as_token_ids else tok)   # vLLM's: logprobs name tokens by id
    decoded = TokenNames(tok)
    with_ids = bool(body.return_token_ids)   # vLLM's: prompt_token_ids and token_ids beside the text
    hide = answer is not None and not answer.shows_logprobs   # hidden reasoning: no output logprobs or token ids

    def logprobs(positions: list[Position]) -> dict | None:
        if not has_logprobs or hide:
            return None
        return chat_logprobs(names, positions, params.logprobs) if chat else completion_logprobs(names, positions)

    def usage(of: list[_Choice]) -> dict:
        """Each prompt of `of` counted once, the tokens of every choice in it (as vLLM: with best_of, only
        the n returned)."""
        p = sum({ch.prompt_index: ch.prompt_len for ch in of}.values())
        c = sum(ch.num_tokens for ch in of)
        details = answer.usage_details([ch.stream.ids for ch in of]) if answer else {}
        cached = {ch.prompt_index: ch.cached for ch in of if ch.cached is not None}
        if cached_details and cached:
            details["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c} | details

    answered = choices         # with best_of, the best n of each prompt once known
    access = access_record(request)
    access.usage = lambda: usage(answered)
    if body.stream:
        opts = body.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts.continuous_usage_stats      # (vLLM's: only with include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_list: list, usage_of: list[_Choice] | None = None, top: dict | None = None) -> str:
            """usage_of: the choices whose usage so far the chunk carries (None: no usage); top: more top-level
            fields."""
            d = {"id": resp_id, "object": obj, "created": created, "model": model_name, "choices": choice_list}
            d.update(top or {})
            if usage_of is not None:
                d["usage"] = usage(usage_of)
            return f"data: {json.dumps(d)}\n\n"

        async def events():
            try:
                if chat:
                    for c in choices:     # vLLM's prompt_token_ids come with each choice's first chunk
                        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}], [c] if continuous else None,
                                    {"prompt_token_ids": prompts[0]} if with_ids else None)
                async for c, piece, positions in _drive(eng, routes, sink):
                    new_ids = with_ids and not hide and c.num_ids_sent < len(c.stream.ids)
                    positions = [] if hide else positions
                    finish = c.finish
                    if c.shape is not None:
                        delta, finish = c.shape.add(piece, final=finish is not None), c.shape.finish_reason(finish)
                    else:
                        delta = {"content": piece} if piece else {}
                    if not (delta if chat else piece) and not positions and finish is None and not new_ids:
                        continue
                    part = {"index": c.index, "delta": delta} if chat else {"index": c.index, "text": piece}
                    part.update(logprobs=logprobs(positions), finish_reason=finish, stop_reason=c.stop_reason)
                    if with_ids:     # the tokens not sent yet (vLLM's delta), and a completion's prompt first
                        if not chat and c.num_ids_sent < 0:
                            part["prompt_token_ids"] = prompts[c.prompt_index]
                        if not hide:
                            part["token_ids"] = c.stream.ids[max(0, c.num_ids_sent):]
                        c.num_ids_sent = len(c.stream.ids)
                    yield chunk([part], [c] if continuous else None)   # usage per choice, as vLLM
                if include_usage:
                    yield chunk([], choices)
            except APIError as e:
                access.error = e.message
                yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect():
        async for c, piece, positions in _drive(eng, routes, sink):
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
    answered = _best(choices, params, n)

    def scored(c: _Choice) -> dict:
        """vLLM's prompt_logprobs and prompt_token_ids of c's prompt, those asked for."""
        out = {} if prompt_k is None else {
            "prompt_logprobs": prompt_logprobs(decoded, prompts[c.prompt_index], c.prompt_scores, prompt_k)}
        return out | ({"prompt_token_ids": prompts[c.prompt_index]} if with_ids else {})

    def generated(c: _Choice) -> dict:
        return {"token_ids": list(c.stream.ids)} if with_ids and not hide else {}

    if chat:
        out = []
        for c in answered:
            text = "".join(c.text)
            message, finish = answer.message(text, c.finish) if answer else ({"role": "assistant", "content": text},
                                                                              c.finish)
            out.append({"index": c.index, "message": message, "logprobs": logprobs(c.positions),
                        "finish_reason": finish, "stop_reason": c.stop_reason} | generated(c))
        extra, obj = scored(answered[0]), "chat.completion"    # one prompt: vLLM puts these beside the choices
    else:
        out = [{"index": c.index, "text": "".join(c.text), "logprobs": logprobs(c.positions),
                "finish_reason": c.finish, "stop_reason": c.stop_reason} | scored(c) | generated(c) for c in answered]
        extra, obj = {}, "text_completion"
    return {"id": resp_id, "object": obj, "created": created, "model": model_name, "choices": out,
            "usage": usage(answered)} | extra
