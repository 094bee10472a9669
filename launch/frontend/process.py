"""The HTTP front in a process of its own, as vLLM's API server is apart from its engine core: JSON, tokenising,
detokenising and the router thread never hold the leader's GIL while it steps the engine.

The leader (attention rank 0 under `serve.py`) starts it with `FrontProcess.start` before loading weights, so
/health answers 503 ("loading") meanwhile. The two processes share three queues: `inbox` (the front's commands
for the leader loop: add, abort, stats, comm_stats, reset_prefix_cache, scale, shutdown), `outbox` (the leader's
progress and answers) and `control` (the leader's word to the front: attach once every rank is ready, then
shutdown). The front dies with the leader (PR_SET_PDEATHSIG) and ignores SIGINT/SIGTERM itself: the leader decides
when to stop. If the front exits on its own, `FrontProcess.watch` puts a shutdown on the leader's inbox, so the job
never serves without a front, and exits non-zero.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time

from ..llm import LLM
from ..procs import Outbox, die_with_parent

START_TIMEOUT_S = 60.0


class FrontLLM(LLM):
    """What the HTTP handlers use of an `LLM` (config, spec, tokenizer, limits, request checks, enqueue, the
    leader's queues), in the front process: no ranks, no runtime. The leader's liveness is the parent's."""

    def __init__(self, model: str, inbox, outbox, info: dict, leader_pid: int, attention_ranks: int,
                 expert_ranks: int, **options):
        self._front(model, attention_ranks, expert_ranks, options)
        self._serving = True
        self._inbox, self._outbox = inbox, outbox
        self._leader_pid = leader_pid
        self._set_limits(info)

    def check_alive(self, what: str = "serving") -> None:
        if os.getppid() != self._leader_pid:
            raise RuntimeError(f"the leader (attention rank 0, pid {self._leader_pid}) died during {what}")


def front_main(host: str, port: int, api_key: str | None, model_name: str, model: str, llm_kwargs: dict,
               inbox, outbox, control, status, leader: int, app_options: dict, http: tuple[dict, dict]) -> None:
    """The front process: serve HTTP at once, attach to the engine when the leader says so, stop when told.
    leader: the leader's pid (compared after the parent-death signal is armed: a leader that died before it
    was leaves this process with another parent); app_options: build_app's keywords (tool_parser, ...); http:
    (the CORS middleware's keywords, uvicorn's TLS and root_path keywords), launch/frontend/http_options.py's."""
    die_with_parent()
    if os.getppid() != leader:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox.cancel_join_thread()   # exiting never waits to flush commands the leader no longer reads
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn
    from starlette.middleware.cors import CORSMiddleware

    from .api_server import attach, build_app, shut_down
    from .middleware import RequestId

    app = build_app(model_name, model, api_key, **app_options)
    cors, server_options = http
    if server_options.pop("request_id_headers", False):
        app.add_middleware(RequestId)
    app.add_middleware(CORSMiddleware, **cors)     # outermost: a preflight needs no API key (nor is it logged)
    app.root_path = server_options.pop("root_path", "")    # the app's, as vLLM's: the prefix is optional
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=3, **server_options))
    thread = threading.Thread(target=server.run, name="afserve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            status.put(("error", f"the HTTP server could not listen on {host}:{port}"))
            return
        time.sleep(0.05)
    status.put(("listening",))
    while True:
        try:
            msg = control.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != leader:
                return
            if not thread.is_alive():     # uvicorn stopped on its own: exit so the leader's watch shuts down
                os._exit(1)
            continue
        if msg[0] == "attach":
            attach(app, FrontLLM(model, inbox, outbox, msg[1], leader, **llm_kwargs))
        elif msg[0] == "shutdown":
            shut_down(app, msg[1])
            server.should_exit = True
            thread.join(timeout=5)
            return


class FrontProcess:
    """The leader's handle on its HTTP front. `inbox`/`outbox` are the leader loop's queues."""

    def __init__(self, host: str, port: int, api_key: str | None, model_name: str, model: str, llm_kwargs: dict,
                 app_options: dict | None = None, http: tuple[dict, dict] | None = None):
        """Spawn the front and return once it listens (SystemExit naming host:port when it cannot). llm_kwargs:
        the leader's LLM arguments after the model (the front checks requests against the same config);
        app_options: build_app's keywords (tool_parser: tool_choice "auto"'s parser, reasoning_parser,
        responses_store); http: front_main's (default: no cross-origin access, plain HTTP)."""
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox, self._control, status = ctx.Queue(), Outbox(ctx), ctx.Queue(), ctx.Queue()
        # Exiting never waits to flush words the front no longer reads (it may be gone).
        self._control.cancel_join_thread()
        self._stopping = False
        self._exited = threading.Event()   # set by the watch thread, the only one that joins the process
        self._watching = False
        self.lost = False      # the front exited on its own: the job shut down for it, and exits non-zero
        self.proc = ctx.Process(target=front_main, name="afserve-http", daemon=True,
                                args=(host, port, api_key, model_name, model, llm_kwargs, self.inbox, self.outbox,
                                      self._control, status, os.getpid(), app_options or {},
                                      http or ({"allow_origins": []}, {})))
        self.proc.start()
        self.outbox.close_reader()   # the front holds it now: progress for a front that is gone is dropped
        # Before multiprocessing's own exit handler, which would SIGTERM the front (ignored) and join it forever.
        atexit.register(self.kill)
        try:
            msg = status.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            msg = ("error", f"the HTTP front did not start within {START_TIMEOUT_S:.0f} s")
        if msg[0] != "listening":
            self.proc.kill()
            raise SystemExit(f"afserve: {msg[1]}")

    def attach(self, info: dict) -> None:
        """Every rank is ready: the front answers requests from now on. info: the runtime's RankInfo as a dict
        (max_model_len, num_kv_blocks, block_size: the request checks' limits)."""
        self._control.put(("attach", info))

    def watch(self) -> None:
        """A thread that shuts the engine down if the front exits while the leader still serves."""
        self._watching = True

        def run():
            self.proc.join()
            self._exited.set()
            if not self._stopping:
                self.lost = True
                logging.getLogger("afserve").error("the HTTP front exited (code %s); shutting down",
                                                   self.proc.exitcode)
                self.inbox.put(("shutdown",))
        threading.Thread(target=run, name="afserve-front-watch", daemon=True).start()

    def stop(self, why: str) -> None:
        """Fail what is still open with a 503 and stop the front (bounded)."""
        self._stopping = True
        self._control.put(("shutdown", why))
        if self._watching:
            self._exited.wait(timeout=8)
        else:
            self.proc.join(timeout=8)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the front if it still runs (the leader is leaving, whatever the reason)."""
        if self.proc.exitcode is None and not self._exited.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.proc.kill()
