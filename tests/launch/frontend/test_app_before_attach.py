"""The HTTP app before an engine is attached (the model still loading), driven as an ASGI app in this process:
the API key is checked before the body is read, and a request for another model is a 404 even while loading."""
from __future__ import annotations

import asyncio
import json

import pytest

from launch.frontend.api_server import build_app

KEY = "k"


def call(app, method: str, path: str, body: bytes = b"", key: str | None = None) -> tuple[int, dict]:
    """One request through the app's ASGI interface -> (status, JSON body)."""
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": headers, "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}
    sent, got = [{"type": "http.request", "body": body, "more_body": False}], []

    async def receive():
        return sent.pop() if sent else {"type": "http.disconnect"}

    async def send(message):
        got.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in got if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in got if m["type"] == "http.response.body")
    return status, json.loads(data or b"{}")


@pytest.fixture(scope="module")
def app():
    return build_app("tiny", "/models/tiny", api_key=KEY, access_log=False)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/admin/drain"])
def test_the_key_is_checked_before_the_body(app, path):
    for body in (b'{"prompt": ', b'{"prompt": "hi"}'):
        status, data = call(app, "POST", path, body)
        assert status == 401 and data["error"]["code"] == "invalid_api_key", (path, body, data)
    status, data = call(app, "POST", path, b'{"prompt": ', key=KEY)
    assert status == 400 and "not valid JSON" in data["error"]["message"], data
    assert call(app, "GET", "/v1/models", key="wrong")[0] == 401


def test_while_loading_another_model_is_a_404_and_this_one_a_503(app):
    status, data = call(app, "POST", "/v1/completions", b'{"model": "gpt-nothing", "prompt": "hi"}', key=KEY)
    assert status == 404 and "gpt-nothing" in data["error"]["message"], data
    status, data = call(app, "POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', key=KEY)
    assert status == 503 and data["error"]["code"] == "loading", data
    assert call(app, "GET", "/health")[0] == 503        # open without the key


def test_ping_and_version_need_no_key(app):
    """vLLM's GET/POST /ping answers as /health (503 while loading); GET /version the package's version (oracle: the
    pyproject.toml this tree is built from), both without the API key."""
    import os

    import tomllib
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        want = tomllib.load(f)["project"]["version"]
    assert call(app, "GET", "/version") == (200, {"version": want})
    for method in ("GET", "POST"):
        assert call(app, method, "/ping") == call(app, "GET", "/health") == (503, {"status": "loading"})
    assert call(app, "GET", "/v1/models")[0] == 401           # the rest still needs it
