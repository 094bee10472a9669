"""vLLM's CPU build as the peer, run from its own venv (`make peers` builds .venv-vllm): finding that venv, the
environment it needs, its offline runner (bench/vllm_offline.py) as a subprocess, and `vllm serve` as a context
manager (what `vllm serve` runs). Nothing here imports vllm; bench/peers.py and bench/serve_load.py --peer vllm use it.

    env = peer_env()
    result = run_offline(".venv-vllm", model, prompts, olens, repeats=3, num_check=4, expect=tokens)
    with VllmServer(".venv-vllm", model) as srv: ... srv.url ...
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time

from launch.local_server import health_status
from launch.procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "bench", "vllm_offline.py")
TOKEN_MISMATCH_EXIT = 3    # bench/vllm_offline.py's exit status when its greedy tokens differ from --expect

# What vLLM's CPU build needs here (bench/vllm_offline.py's docstring says how each was found). The KV cache gets
# 1 GiB (209,664 tokens of the shipped model) instead of 92% of the memory node, which fails to start when less is
# free. The OpenMP binding stays vLLM's default, "auto": on 2 cores one worker thread on core 0 and core 1 left to
# the engine-core process, which busy-polls. Binding the worker to both cores ("0-1") measured the same within this
# shared VM's noise (bench/vllm_offline.py on the full workload, 3 runs each, interleaved: medians 2726 and 2556
# tok/s against auto's 2733 and 2787).
# VLLM_SERVER_DEV_MODE turns on vLLM's POST /reset_prefix_cache, which bench/serve_load.py calls before each run.
PEER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_SERVER_DEV_MODE": "1"}


class TokenMismatch(RuntimeError):
    """The peer's greedy tokens differ from ours: no ratio between the two means anything."""


def peer_python(venv: str) -> str:
    """The venv's python (venv relative to the repository root unless absolute); a clear error if it is absent."""
    path = venv if os.path.isabs(venv) else os.path.join(ROOT, venv)
    python = os.path.join(path, "bin", "python")
    if not os.access(python, os.X_OK):
        raise RuntimeError(f"no python in the peer venv {path!r}: build it with `make peers` (vllm-cpu in "
                           f".venv-vllm) or pass --peer-venv DIR")
    return python


def peer_env() -> dict[str, str]:
    """This process's environment with PEER_ENV added (a variable already set wins) and PYTHONPATH dropped: afserve's
    top-level packages (models, kernels, launch) must not shadow the peer venv's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for k, v in PEER_ENV.items():
        env.setdefault(k, v)
    return env


def run_offline(venv: str, model: str, prompts: list[list[int]], olens: list[int], repeats: int, num_check: int,
                expect: list[list[int]] | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                timed: list[tuple[list[list[int]], list[int]]] | None = None, kv_space_gib: int | None = None,
                timeout_s: float = 1800.0) -> dict:
    """bench/vllm_offline.py's JSON result (see its docstring). timed: one (prompts, olens) workload per timed run
    (else each run is prompts, olens again); kv_space_gib: VLLM_CPU_KVCACHE_SPACE (else PEER_ENV's). Raises
    TokenMismatch when its check tokens differ from expect, RuntimeError on any other failure, with the tail of
    vLLM's log either way."""
    with tempfile.TemporaryDirectory(prefix="afserve-peers-") as tmp:
        requests, log = os.path.join(tmp, "requests.json"), os.path.join(tmp, "vllm.log")
        with open(requests, "w") as f:
            work = {"prompts": prompts, "olens": olens}
            if timed is not None:
                work["timed"] = [{"prompts": p, "olens": o} for p, o in timed]
            json.dump(work, f)
        cmd = [peer_python(venv), RUNNER, "--model", os.path.abspath(model), "--requests", requests,
               "--repeats", str(repeats), "--num-check", str(num_check), "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens)]
        if expect is not None:
            cmd += ["--expect", os.path.join(tmp, "expect.json")]
            with open(cmd[-1], "w") as f:
                json.dump(expect, f)
        env = peer_env()
        if kv_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
        with open(log, "w") as err:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=tmp,
                               timeout=timeout_s)
        with open(log, errors="replace") as f:
            tail = f.read()[-4000:]
    if r.returncode == TOKEN_MISMATCH_EXIT:
        raise TokenMismatch(tail.strip().splitlines()[-1])
    if r.returncode != 0:
        raise RuntimeError(f"bench/vllm_offline.py exited with status {r.returncode}; its log ends:\n{tail}")
    return json.loads(r.stdout)


class VllmServer:
    """vLLM's OpenAI-compatible server (what `vllm serve` runs) from the peer venv on a free loopback port, started
    as launch/local_server.py's LocalServer starts ours: in its own process group, healthy once GET /health answers
    200, the whole group killed at exit. args: more server flags (e.g. --dtype float32)."""

    def __init__(self, venv: str, model: str, args: list[str] | None = None, startup_timeout_s: float = 600.0):
        # `vllm serve`'s own module: the `vllm` script of vllm-cpu 0.32.0 fails at start, asking the package metadata
        # for a distribution named "vllm" (PackageNotFoundError: this one is "vllm-cpu").
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [peer_python(venv), "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(model),
                    "--host", "127.0.0.1", "--port", str(self.port), *(args or [])]
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        # Its own empty working directory: `python -m` puts the working directory first on sys.path.
        self.workdir = tempfile.mkdtemp(prefix="vllm-serve-")
        self.log_path = os.path.join(self.workdir, "vllm.log")

    def __enter__(self) -> VllmServer:
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=peer_env(),
                                         cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while self.health() != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {self.proc.returncode} while starting; its log "
                                   f"({self.log_path}) ends:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve was not healthy within {self.startup_timeout_s} s; its log "
                                   f"({self.log_path}) ends:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def health(self) -> int:
        return health_status(self.url)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        """SIGTERM to the process group (the API server and its engine-core process), then SIGKILL to whatever of
        the group is left, so no engine process outlives the bench."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
