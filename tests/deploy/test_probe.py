"""deploy/probe.py, the pods' exec probe: `ready` against a local HTTP server answering as /health does, and
`alive` on a made-up /proc."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "deploy" / "probe.py"


def load_probe():
    spec = importlib.util.spec_from_file_location("afserve_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


probe = load_probe()


@contextlib.contextmanager
def serving(handler):
    """A local HTTP server in a thread, answering with handler (a BaseHTTPRequestHandler class) -> its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def health():
    """A server whose /health answers state["code"]; yields (url, state)."""
    state = {"code": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            code = state["code"] if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b'{"status": "loading"}' if code == 503 else b'{"status": "ok"}')

        def log_message(self, *args):
            pass

    with serving(Handler) as base:
        yield base + "/health", state


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ready_only_on_200(health):
    url, state = health
    assert probe.main(["ready", url]) == 0
    state["code"] = 503
    assert probe.main(["ready", url]) == 1
    assert "503" in probe.check_ready(url, 2.0)
    assert probe.main(["ready", f"http://127.0.0.1:{closed_port()}/health", "--timeout-s", "2"]) == 1


def fake_proc(root: Path, processes: dict[int, tuple[list[str], str]]) -> str:
    """processes: pid -> (argv, state letter) written as /proc/PID/cmdline and /proc/PID/stat."""
    for pid, (argv, state) in processes.items():
        d = root / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
        (d / "stat").write_text(f"{pid} (python3) {state} 1 {pid} {pid} 0 -1\n")
    (root / "self").mkdir()
    return str(root)


AGENT = ["/usr/local/bin/python", "/usr/local/bin/torchrun", "--standalone", "--nproc-per-node", "2", "-m",
         "launch.serve", "--role", "expert"]
RANK = ["/usr/local/bin/python", "-u", "-m", "launch.serve", "--role", "expert"]


def test_alive_counts_rank_processes_not_the_launcher(tmp_path):
    proc = fake_proc(tmp_path, {1: (AGENT, "S"), 7: (RANK, "S"), 8: (RANK, "R"), 9: (["sleep", "1"], "S")})
    assert sorted(probe.rank_processes(proc)) == [(7, "S"), (8, "R")]
    assert probe.check_alive(2, proc) is None
    assert "2 rank processes run, 3 expected" in probe.check_alive(3, proc)


def test_alive_fails_on_a_zombie_rank(tmp_path):
    proc = fake_proc(tmp_path, {1: (AGENT, "S"), 7: (RANK, "S"), 8: (RANK, "Z")})
    assert probe.check_alive(1, proc) == "rank processes [8] are zombies"


def test_alive_checks_health_on_the_leader_pod_only(health, monkeypatch):
    url, state = health
    monkeypatch.setattr(probe, "check_alive", lambda num_ranks, proc="/proc": None)
    monkeypatch.setenv("AFSERVE_HEALTH_URL", url)
    state["code"] = 503
    monkeypatch.setenv("AFSERVE_LEADER_POD", "afserve-attention-0")
    monkeypatch.setattr(socket, "gethostname", lambda: "afserve-attention-1")
    assert probe.main(["alive"]) == 0          # not the leader: no HTTP server to ask
    monkeypatch.setattr(socket, "gethostname", lambda: "afserve-attention-0")
    assert probe.main(["alive"]) == 1          # the leader whose /health says 503
    state["code"] = 200
    assert probe.main(["alive"]) == 0


@pytest.fixture
def leader():
    """A server standing in for the leader's /admin/drain: answers state["code"] and records each POST as
    (path, authorization header, JSON body); yields (url, state)."""
    state = {"code": 200, "posts": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["posts"].append((self.path, self.headers.get("Authorization"), body))
            self.send_response(state["code"])
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    with serving(Handler) as base:
        yield base + "/admin/drain", state


def test_drain_names_this_host_to_the_leader_with_the_key(leader, monkeypatch):
    url, state = leader
    monkeypatch.setattr(socket, "gethostname", lambda: "afserve-expert-7f9c")
    monkeypatch.setenv("AFSERVE_LEADER_POD", "afserve-attention-0")
    monkeypatch.setenv("AFSERVE_API_KEY", "sekrit")
    assert probe.main(["drain", url]) == 0
    assert state["posts"] == [("/admin/drain", "Bearer sekrit", {"hosts": ["afserve-expert-7f9c"]})]
    state["code"] = 400                        # the leader refused (say, the last expert rank)
    assert probe.main(["drain", url]) == 1
    monkeypatch.delenv("AFSERVE_API_KEY")
    state["code"] = 200
    assert probe.main(["drain", url]) == 0 and state["posts"][-1][1] is None
    assert probe.main(["drain", f"http://127.0.0.1:{closed_port()}/admin/drain", "--timeout-s", "1"]) == 1


def test_drain_on_the_leader_pod_asks_nothing(leader, monkeypatch):
    url, state = leader
    monkeypatch.setenv("AFSERVE_LEADER_POD", "afserve-attention-0")
    monkeypatch.setattr(socket, "gethostname", lambda: "afserve-attention-0")
    assert probe.main(["drain", url]) == 0 and state["posts"] == []
