"""vLLM's `use_beam_search` on completions and chat completions: launch/beam_search.py's search, each step's beams
sent to the engine as one-token requests through the engine client. The answer has n choices per prompt, its n
best beams (n is the beam width), best first; not streamed. Of the sampling fields only max_tokens, temperature,
ignore_eos, include_stop_str_in_output and skip_special_tokens apply (as in vLLM, which ignores the others), with
vLLM's length_penalty."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse

from attention_nodes.sampling_params import SamplingParams

from ..beam_search import BeamSearchParams, BeamSequence, Searches
from .answer import ChatAnswer
from .engine_client import EngineClient, Progress, engine_down
from .protocol import APIError


def check(body) -> None:
    """A 400 naming the field when a beam search request asks for what it cannot give: a stream, an echo,
    logprobs, or a constrained output (structured outputs or a required or named tool choice: the steps are not
    constrained)."""
    if body.stream:
        raise APIError(400, "use_beam_search cannot stream (as in vLLM): pass stream false", "stream")
    if getattr(body, "echo", False):
        raise APIError(400, "use_beam_search does not echo the prompt: leave echo out", "echo")
    logprobs, prompt_logprobs = body.logprob_counts()
    if logprobs is not None or prompt_logprobs is not None:
        name = "prompt_logprobs" if logprobs is None else "logprobs"
        raise APIError(400, f"use_beam_search does not return {name}: leave {name} out", name)
    if (name := body.structured()[1]) is not None:
        raise APIError(400, f"use_beam_search does not constrain its beams ({name}): leave {name} out", name)


def sampled(body):
    """The request as its sampling parameters are checked for the search's steps: one sample each (n is the
    beam width, whatever max_num_seqs)."""
    return body.model_copy(update={"n": 1, "best_of": None})


async def _step(eng: EngineClient, beams: list[list[int]], params, request: Request) -> list[dict[int, float]]:
    """Each beam's next token candidates ({token id: log-probability}), from one one-token request per beam."""
    sink: asyncio.Queue = asyncio.Queue()
    rids: list[str] = []
    got: dict[str, dict[int, float]] = {}
    try:
        for b in beams:     # (within the try: a failed submit releases those made)
            rids.append(eng.submit(b, params, sink))
        while len(got) < len(rids):
            try:
                row: Progress = await asyncio.wait_for(sink.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected") from None
                continue
            if row.token_ids is None:
                raise engine_down(row.finish)
            if row.finish == "abort":      # the engine dropped it (a drain, say): the search cannot go on
                raise APIError(503, "the engine aborted a beam search step; retry the request", kind="server_error")
            if row.finish is not None:
                got[row.request_id] = row.logprobs[0]
                eng.finished(row.request_id, row.finish)
    finally:
        for rid in rids:
            if rid not in got:
                eng.release(rid, "abort")
    return [got[rid] for rid in rids]


async def run(eng: EngineClient, prompts: list[list[int]], params: list[BeamSearchParams], request: Request,
              cache_salt: str | None = None) -> list[list[BeamSequence]]:
    """Every prompt's search at once (params: each one's, which differ in max_tokens at most), each step one
    request per live beam of every prompt (under the request's cache_salt). Stops with a 499 once the client is
    gone."""
    searches = Searches(prompts, params, frozenset(eng.llm.spec.eos_token_ids))
    step = replace(params[0].step_params(), cache_salt=cache_salt)
    while not searches.done:
        if await request.is_disconnected():
            raise APIError(499, "client disconnected")
        beams = searches.beams()
        searches.answer(beams, await _step(eng, [b for _, b in beams], step, request))
    return searches.found


async def answer(model_name: str, eng: EngineClient, body, request: Request, prompts: list[list[int]],
                 per_prompt: list[SamplingParams], chat: bool, shape: ChatAnswer | None = None):
    """The JSON answer of a beam search request (a 499 if the client left). per_prompt: the sampling parameters
    the request makes for each prompt, whose max_tokens and temperature the search takes."""
    try:
        params = [BeamSearchParams(beam_width=body.n, max_tokens=q.max_tokens, ignore_eos=body.ignore_eos,
                                   temperature=q.temperature, length_penalty=body.length_penalty,
                                   include_stop_str_in_output=body.include_stop_str_in_output) for q in per_prompt]
    except ValueError as e:
        field = str(e).split("=")[0].removeprefix("BeamSearchParams.")
        raise APIError(400, str(e), {"beam_width": "n"}.get(field, field)) from e
    try:
        found = await run(eng, prompts, params, request, per_prompt[0].cache_salt)
    except APIError as e:
        if e.status != 499:
            raise
        return JSONResponse(e.body(), status_code=499)
    choices, outputs = [], []
    skip = body.skip_special_tokens and not (shape and shape.keeps_special_tokens)
    ids = bool(body.return_token_ids)       # vLLM's: the prompt's and each choice's token ids
    for p, best in enumerate(found):
        for i, beam in enumerate(best):
            outputs.append(beam.output_ids)
            text = eng.llm.tokenizer.decode(beam.output_ids, skip_special_tokens=skip)
            choice = {"index": p * body.n + i, "logprobs": None, "finish_reason": beam.finish_reason,
                      "stop_reason": beam.stop_reason} | ({"token_ids": beam.output_ids} if ids else {})
            if chat:
                message, finish = shape.message(text, beam.finish_reason) if shape else (
                    {"role": "assistant", "content": text}, beam.finish_reason)
                choices.append(choice | {"message": message, "finish_reason": finish})
            else:
                choices.append(choice | {"text": text} | ({"prompt_token_ids": prompts[p]} if ids else {}))
    prompt_tokens, completion_tokens = sum(len(p) for p in prompts), sum(len(o) for o in outputs)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens} | (shape.usage_details(outputs) if shape else {})
    return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "object": "chat.completion" if chat else "text_completion", "model": model_name, "choices": choices,
            "usage": usage} | ({"prompt_token_ids": prompts[0]} if chat and ids else {})
