"""The HTTP app of launch/frontend/api_server.py on uvicorn in a thread of the test process, attached to an `LLM`
(its ranks spawned): the front without torchrun, for tests that need the engine's answers beside the server's."""
from __future__ import annotations

import contextlib
import threading
import time


@contextlib.contextmanager
def serving(llm, path: str, model_name: str, **app_options):
    """Yield (port, the app's EngineClient) while the app serves llm on a free loopback port; app_options go to
    build_app (tool_parser, reasoning_parser). Once attached, the app's router thread owns llm's outbox: take the
    Python API's answers first."""
    import uvicorn

    from launch.frontend.api_server import attach, build_app, shut_down

    app = build_app(model_name, path, access_log=False, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    client = attach(app, llm)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], client
    finally:
        shut_down(app, "the tests are over")
        server.should_exit = True
        thread.join(timeout=10)
