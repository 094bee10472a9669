"""The HTTP front's access log: one INFO line per request on logger "afserve.http.access", written when the
response has been sent in full (for a stream: when it ends, or when the client goes away).

    127.0.0.1:54124 "POST /v1/completions" 200 prompt_tokens=7 completion_tokens=5 latency_ms=71.3
    127.0.0.1:53882 "POST /v1/completions" 400 prompt_tokens=- completion_tokens=- latency_ms=1.8 error="max_tokens:
        Input should be a valid integer (got 'many')"      (one line in the log)

Token counts are those of completion and chat requests that reached the engine ("-" otherwise); `error` is
the message of an error answer (or of an error that ended a stream). Handlers fill in the `AccessRecord`
that `access_record(request)` returns; `AccessLog` (ASGI middleware) times the request and writes the line.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

ACCESS_LOGGER = "afserve.http.access"
logger = logging.getLogger(ACCESS_LOGGER)


@dataclass(slots=True)
class AccessRecord:
    """What the access line says about one request beyond its method, path, status and latency."""

    usage: Callable[[], dict] | None = None   # live {"prompt_tokens", "completion_tokens", ...} of a generation
    error: str | None = None                  # the message of an error answer


def access_record(request) -> AccessRecord:
    """The record of this request (a throwaway one when the app runs without `AccessLog`)."""
    rec = getattr(request.state, "access", None)
    return rec if rec is not None else AccessRecord()


class AccessLog:
    """ASGI middleware: writes one access line per HTTP request once its response is over."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rec = AccessRecord()
        scope.setdefault("state", {})["access"] = rec      # request.state.access in handlers
        start = time.perf_counter()
        status = 0

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as e:
            if status == 0:     # ServerErrorMiddleware (outside this one) answers it with a 500
                status, rec.error = 500, rec.error or f"{type(e).__name__}: {e}"
            raise
        finally:
            if logger.isEnabledFor(logging.INFO):
                logger.info("%s", _line(scope, status, rec, (time.perf_counter() - start) * 1e3))


def _line(scope, status: int, rec: AccessRecord, latency_ms: float) -> str:
    """status 0: no response was started (the request was cancelled); shown as "-"."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    usage = rec.usage() if rec.usage is not None else {}
    prompt, completion = usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-")
    line = (f'{who} "{scope["method"]} {scope["path"]}" {status or "-"} prompt_tokens={prompt} '
            f"completion_tokens={completion} latency_ms={latency_ms:.1f}")
    if rec.error is not None:
        line += f" error={json.dumps(rec.error)}"
    return line
