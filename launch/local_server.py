"""Start `serve.py` under torchrun on this machine and wait until it is healthy (tests and benchmarks use it).

    with LocalServer(model_dir, nproc=3, args=["--attention-ranks", "1"]) as srv:
        ... srv.url ..., srv.rank_pids, srv.log()
"""
from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from .procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def health_status(url: str, context: ssl.SSLContext | None = None) -> int:
    """GET url/health -> its HTTP status, or 0 when nothing answers (yet). context: an https url's."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class LocalServer:
    def __init__(self, model: str, nproc: int, args: list[str] | None = None, port: int | None = None,
                 startup_timeout_s: float = 180.0):
        self.model, self.nproc, self.args = model, nproc, list(args or [])
        self.port = port or free_port()
        # With --ssl-certfile the server speaks HTTPS; the client side trusts that certificate (made for 127.0.0.1)
        cert = next((a.split("=", 1)[1] if "=" in a else self.args[i + 1] for i, a in enumerate(self.args)
                     if a.split("=", 1)[0] == "--ssl-certfile"), None)
        self.ssl_context = None if cert is None else ssl.create_default_context(cafile=cert)
        self.url = f"http{'' if cert is None else 's'}://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.health_seen: list[int] = []    # /health statuses observed while starting (0: no answer)
        self.proc: subprocess.Popen | None = None
        fd, self.log_path = tempfile.mkstemp(prefix="afserve-", suffix=".log")
        os.close(fd)

    def start(self) -> LocalServer:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc),
               "--master-port", str(free_port()), os.path.join(ROOT, "launch", "serve.py"), "--model", self.model,
               "--port", str(self.port), *self.args]
        with open(self.log_path, "w") as out:   # the children keep their own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            status = self.health()
            if not self.health_seen or self.health_seen[-1] != status:
                self.health_seen.append(status)
            if status == 200:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} while starting:\n"
                                   f"{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not healthy within {self.startup_timeout_s} s:\n"
                                   f"{self.log()[-4000:]}")
            time.sleep(0.1)

    def health(self) -> int:
        return health_status(self.url, self.ssl_context)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @property
    def rank_pids(self) -> dict[int, int]:
        """rank -> pid, from the ranks' "ready" lines."""
        return {int(r): int(p) for r, p in re.findall(r"afserve: rank (\d+) \(\w+\) pid (\d+) ready", self.log())}

    @property
    def front_pid(self) -> int | None:
        """The HTTP front's process (serve.py's "HTTP front pid" line), once the engine is attached."""
        found = re.findall(r"afserve: HTTP front pid (\d+)", self.log())
        return int(found[0]) if found else None

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=60, context=self.ssl_context) as r:
            return r.read().decode()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL to the whole process group if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        if self.wait(20) is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
