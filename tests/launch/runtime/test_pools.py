"""Separate pool launches (launch/serve.py --role ... --pool-addr): one torchrun for the attention pool, one
of two ranks for the expert pool, a second expert launch (another emulated node), and a launch of one
attention rank that joins the running job. The job serves transformers' greedy tokens over HTTP; killing the
second expert node's torchrun, draining an expert rank through /admin/drain and killing the joined attention
rank's torchrun each leave the server answering, and requests streaming through each of those changes end
with exactly the tokens they would have had."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import openai
import pytest

from launch.local_server import ROOT, LocalServer
from launch.procs import free_port
from launch.runtime.sizing import host_cores
from tests.conftest import FULL, hf_greedy
from tests.dist_utils import alive
from tests.launch.frontend.test_http_server import post

KEY = "pool-key"
MAX_NEW = 40


class PoolLaunch:
    """One `torchrun ... serve.py --role ROLE --pool-addr ADDR` in its own process group (one emulated node);
    with host, in a UTS namespace of its own whose hostname is host (another machine, as its ranks see it)."""

    def __init__(self, model: str, role: str, pool_addr: str, *args: str, nproc: int = 1, host: str | None = None):
        fd, self.log_path = tempfile.mkstemp(prefix=f"afserve-{role}-", suffix=".log")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), os.path.join(ROOT, "launch", "serve.py"), "--model", model, "--role", role,
               "--pool-addr", pool_addr, *args]
        if host is not None:
            cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *cmd]
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        os.close(fd)

    @property
    def pids(self) -> list[int]:
        """Its ranks' processes, from their "ready" lines."""
        return [int(p) for p in re.findall(r"afserve: rank \d+ \(\w+\) pid (\d+) ready", self.log())]

    def kill(self) -> None:
        """SIGKILL the whole node: its ranks (torchrun starts each in a session of its own) and torchrun's agent."""
        for pid in self.pids:
            os.kill(pid, signal.SIGKILL)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def gauge(srv: LocalServer, name: str, label: str = "") -> float:
    m = re.search(rf"^{name}{re.escape(label)} (\S+)$", srv.metrics(), re.M)
    assert m, f"{name}{label} not in /metrics"
    return float(m.group(1))


def wait_for_pools(srv: LocalServer, attention: int, expert: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while (gauge(srv, "afserve_pool_ranks", '{pool="attention"}'), gauge(srv, "afserve_pool_ranks",
                                                                            '{pool="expert"}')) != (attention, expert):
        assert time.monotonic() < deadline, f"the pools never became {attention} + {expert}:\n{srv.log()[-3000:]}"
        time.sleep(0.3)


async def _streams(url: str, prompts: list[list[int]], on_tokens) -> list[tuple[str, str]]:
    """Stream completions of prompts side by side; on_tokens(total chunks so far) runs as chunks arrive."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=240)
    seen = [0]

    async def one(p):
        text, finish = "", None
        stream = await client.completions.create(model="tiny", prompt=p, max_tokens=MAX_NEW, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            seen[0] += 1
            on_tokens(seen[0])
        return text, finish
    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def stream_through(srv: LocalServer, prompts, after_chunks: int, action) -> list[tuple[str, str]]:
    """Stream prompts side by side and run action() once after_chunks chunks have arrived."""
    done = [False]

    def on_tokens(n):
        if not done[0] and n >= after_chunks:
            done[0] = True
            action()
    out = asyncio.run(_streams(srv.url, prompts, on_tokens))
    assert done[0], "the streams ended before the change"
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


def test_separate_pool_launches_serve_and_survive(model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 71 + i, 12 + 3 * i] for i in range(8)]
    expected = [tok.decode(t, skip_special_tokens=True) for t in hf_greedy(model_dir, prompts, MAX_NEW)]
    addr = f"127.0.0.1:{free_port()}"
    common = ["--max-model-len", "128", "--heartbeat-s", "0.5"]
    experts = [PoolLaunch(model_dir, "expert", addr, *common, nproc=2),    # the expert pool: two emulated nodes
               PoolLaunch(model_dir, "expert", addr, *common)]
    srv = LocalServer(model_dir, nproc=1, args=["--role", "attention", "--pool-addr", addr, "--expert-ranks", "3",
                                                "--api-key", KEY, "--served-model-name", "tiny", *common])
    joiner = None
    try:
        srv.start()                     # healthy once the three expert ranks registered and loaded
        joiner = PoolLaunch(model_dir, "attention", addr, "--leader-host", "not-this-host", *common)
        wait_for_pools(srv, 2, 3)
        # auto's micro-batches count the five ranks of the four launches on this machine, not the leader's launch
        assert gauge(srv, "afserve_micro_batches") == (2 if host_cores() >= 5 else 1)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=240)
        for p, want in zip(prompts[:2], expected[:2]):
            got = client.completions.create(model="tiny", prompt=p, max_tokens=MAX_NEW, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == want

        # the second expert node dies while two requests stream: 2 + 3 -> 2 + 2
        out = stream_through(srv, prompts[2:4], 8, experts[1].kill)
        assert out == [(e, "length") for e in expected[2:4]]
        wait_for_pools(srv, 2, 2)

        # drain an expert rank (rank 3: one of the first launch's two) through the admin endpoint: it leaves
        status, body = post(srv, "/admin/drain", {"ranks": [3]}, key=None)
        assert status == 401, body
        status, body = post(srv, "/admin/drain", {"ranks": [0]}, key=KEY)
        assert status == 400 and "rank 0" in body["error"]["message"], body
        status, body = post(srv, "/admin/drain", {"ranks": [3]}, key=KEY)
        assert status == 200 and body["lost"] == [3] and body["expert_ranks"] == 1, body
        deadline = time.monotonic() + 30
        while all(map(alive, experts[0].pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(map(alive, experts[0].pids)) == [False, True]    # the drained rank exited, its peer serves
        assert experts[0].proc.poll() is None

        # the joined attention rank's torchrun dies while two requests stream (one of them on it): 2 + 1 -> 1 + 1
        out = stream_through(srv, prompts[4:6], 8, joiner.kill)
        assert out == [(e, "length") for e in expected[4:6]]
        wait_for_pools(srv, 1, 1)
        assert gauge(srv, "afserve_micro_batches") == (2 if host_cores() >= 2 else 1)
        assert gauge(srv, "afserve_requests_moved_total") >= 1
        got = client.completions.create(model="tiny", prompt=prompts[6], max_tokens=MAX_NEW, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected[6]
        assert srv.health() == 200
    finally:
        srv.stop()
        for p in experts + ([joiner] if joiner else []):
            if p.wait(20) is None:
                p.stop()
    assert "the engine failed" not in srv.log(), srv.log()[-3000:]
    assert experts[0].proc.returncode == 0, experts[0].log()[-3000:]   # both its ranks left cleanly (one drained)


@FULL   # ~30 s: make test-full (make test launches pools separately without PD)
def test_pd_pools_launch_separately_and_a_prefill_rank_joins_the_running_job(model_dir):
    """PD over separate pool launches: the leader's launch (--role attention --prefill-ranks 1, two attention
    ranks in all) is the prefill rank, a --role decode launch the decode rank, an expert launch the expert pool;
    the job forms once both have registered. A --role prefill launch then joins the running job as a second
    prefill rank (the pool gauges say 2 prefill + 1 decode). Every completion is transformers' greedy text, and
    every request moved from a prefill rank to the decode rank."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 71 + i, 12 + 3 * i] for i in range(6)]
    expected = [tok.decode(t, skip_special_tokens=True) for t in hf_greedy(model_dir, prompts, MAX_NEW)]
    addr = f"127.0.0.1:{free_port()}"
    common = ["--max-model-len", "128", "--heartbeat-s", "0.5"]
    launches = [PoolLaunch(model_dir, "expert", addr, *common), PoolLaunch(model_dir, "decode", addr, *common)]
    srv = LocalServer(model_dir, nproc=1, args=["--role", "attention", "--pool-addr", addr, "--attention-ranks", "2",
                                                "--prefill-ranks", "1", "--expert-ranks", "1", "--api-key", KEY,
                                                "--served-model-name", "tiny", *common])
    try:
        srv.start()
        wait_for_pools(srv, 2, 1)
        assert [gauge(srv, "afserve_pool_ranks", f'{{pool="{p}"}}') for p in ("prefill", "decode")] == [1, 1]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=240)

        def complete(p):
            return client.completions.create(model="tiny", prompt=p, max_tokens=MAX_NEW, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        assert [complete(p) for p in prompts[:2]] == expected[:2]
        launches.append(PoolLaunch(model_dir, "prefill", addr, *common))
        wait_for_pools(srv, 3, 1)
        assert [gauge(srv, "afserve_pool_ranks", f'{{pool="{p}"}}') for p in ("prefill", "decode")] == [2, 1]
        out = stream_through(srv, prompts[2:], 1, lambda: None)
        assert out == [(e, "length") for e in expected[2:]]
        assert gauge(srv, "afserve_pd_requests_transferred_total") == len(prompts)
    finally:
        srv.stop()
        for p in launches:
            if p.wait(20) is None:
                p.stop()
    assert "the engine failed" not in srv.log(), srv.log()[-3000:]
    assert all(p.proc.returncode == 0 for p in launches), [p.log()[-2000:] for p in launches]


def test_drain_a_host_then_the_leader_dying_ends_the_other_launches(model_dir):
    """A pod's preStop drain names its host: every rank there leaves between steps and its launch ends cleanly.
    The leader is the one single point of failure: when its process dies, the expert launch left (whose second
    rank joined the running job after the first formed it) ends within seconds instead of hanging."""
    addr = f"127.0.0.1:{free_port()}"
    experts = PoolLaunch(model_dir, "expert", addr, nproc=2)
    other = PoolLaunch(model_dir, "expert", addr, host="expert-node-b")
    srv = LocalServer(model_dir, nproc=1, args=["--role", "attention", "--pool-addr", addr, "--expert-ranks", "1",
                                                "--api-key", KEY])
    try:
        srv.start()
        wait_for_pools(srv, 1, 3)
        status, body = post(srv, "/admin/drain", {"hosts": ["nowhere"]}, key=KEY)
        assert status == 400 and "no rank of the job runs on host(s) ['nowhere']" in body["error"]["message"]
        status, body = post(srv, "/admin/drain", {"hosts": ["expert-node-b"]}, key=KEY)
        assert status == 200 and len(body["lost"]) == 1 and body["expert_ranks"] == 2, body
        assert other.wait(30) == 0, other.log()[-3000:]
        (leader,) = srv.rank_pids.values()
        os.kill(leader, signal.SIGKILL)
        t0 = time.monotonic()
        code = experts.wait(30)
        took = time.monotonic() - t0
    finally:
        srv.stop()
        for p in (experts, other):
            p.stop()
    assert code not in (None, 0) and took < 10, (code, took, experts.log()[-3000:])
