"""Bad input raises ValueError naming the bad value; a crashed rank fails generate fast, with no orphans."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import threading
import time

import pytest

from launch import LLM, SamplingParams
from tests.dist_utils import alive


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=1, expert_ranks=1) as engine:
        yield engine


@pytest.mark.parametrize("a,e,name", [(0, 1, "attention_ranks=0"), (1, 0, "expert_ranks=0"),
                                      (-2, 1, "attention_ranks=-2")])
def test_rank_counts_below_one(tiny_checkpoint, a, e, name):
    with pytest.raises(ValueError, match=name):
        LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=a, expert_ranks=e)


def test_world_size_not_a_plus_e(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(ValueError, match=r"world size 5 != attention_ranks \+ expert_ranks = 3"):
        LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=1, expert_ranks=2)


@pytest.mark.parametrize("options,words", [
    ({"role": "expert"}, "role='expert' and pool_addr=None"),
    ({"pool_addr": "127.0.0.1:29400"}, "role=None and pool_addr='127.0.0.1:29400'"),
    ({"role": "router", "pool_addr": "h:1"}, "role='router' is invalid"),
    ({"role": "expert", "pool_addr": "h:port"}, "pool_addr='h:port' is invalid: pass HOST:PORT"),
    ({"role": "expert", "pool_addr": "h:70000"}, "pool_addr='h:70000' is invalid"),
])
def test_bad_pool_options(tiny_checkpoint, options, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        LLM(tiny_checkpoint("qwen3_moe"), **options)


def test_scale_requests_are_checked_before_they_reach_the_ranks(llm):
    for kwargs, words in (({"expert_ranks": 0}, "expert_ranks=0 is invalid"),
                          ({"attention_ranks": True}, "attention_ranks=True is invalid"),
                          ({"expert_ranks": 99}, "expert_ranks=99 exceeds the model's 8 experts"),
                          ({"retire": [0]}, "retire=[0] is invalid: name ranks 1 and up")):
        with pytest.raises(ValueError, match=re.escape(words)):
            llm.scale(**kwargs)


def test_unknown_option(tiny_checkpoint):
    with pytest.raises(ValueError, match="unknown option 'max_num_seq'"):
        LLM(tiny_checkpoint("qwen3_moe"), max_num_seq=4)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_corrupt_checkpoint(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen3_moe"), tmp_path / "corrupt")
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors.*corrupt"):
        LLM(path)


def test_missing_shard(tiny_checkpoint, tmp_path):
    from models.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint("mixtral", tmp_path / "sharded", max_shard_size="20KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(ValueError, match=f"{victim}.*missing"):
        LLM(path)


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen3_moe"), tmp_path / "llama")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["model_type"] = "llama"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="model_type 'llama'.*not supported"):
        LLM(path)


def test_too_many_expert_ranks(tiny_checkpoint):
    with pytest.raises(ValueError, match="expert_ranks=9 exceeds the model's 8 experts"):
        LLM(tiny_checkpoint("qwen3_moe"), expert_ranks=9)


def test_prompt_errors(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate("")
    with pytest.raises(ValueError, match="exceeds max_model_len=512"):
        llm.generate([[5] * 600])
    with pytest.raises(ValueError, match=r"500 tokens \+ max_tokens=16 = 516 exceeds max_model_len=512"):
        llm.generate([[5] * 500])
    with pytest.raises(ValueError, match="token id 9999 is outside the vocabulary"):
        llm.generate([[5, 9999]])
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[5]], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("kwargs,name", [
    ({"max_tokens": 0}, "max_tokens=0"), ({"temperature": -1.0}, "temperature=-1.0"),
    ({"top_p": 1.5}, "top_p=1.5"), ({"top_k": -3}, "top_k=-3"), ({"seed": "x"}, "seed='x'"),
    ({"stop_token_ids": [-1]}, "stop_token_ids=\\[-1\\]"), ({"max_tokens": 2.5}, "max_tokens=2.5"),
    ({"seed": 2**64}, f"seed={2**64}"), ({"seed": -2**63 - 1}, f"seed={-2**63 - 1}"),
    ({"seed": 2**64 - 1, "n": 2}, f"seed={2**64 - 1}.*2\\*\\*64 - 2"),   # sample 1 would draw from 2**64
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens=10.*max_tokens=5"),
])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_vllms_spellings_of_off_and_none_are_taken():
    p = SamplingParams(top_k=-1, stop_token_ids=None)
    assert (p.top_k, p.stop_token_ids) == (0, [])
    assert SamplingParams(seed=2**64 - 2, n=2).seed == 2**64 - 2


def test_params_changed_after_construction_are_checked_in_the_caller(llm):
    """A field set to a bad value after construction fails in generate, not on a rank (whose death would end
    the job); the next test then finds the engine serving."""
    p = SamplingParams(max_tokens=4)
    p.top_p = 0
    with pytest.raises(ValueError, match="top_p=0"):
        llm.generate([[5, 6, 7]], p)
    p = SamplingParams(max_tokens=4, n=2, seed=2**64 - 2)
    p.n = 3
    with pytest.raises(ValueError, match="seed="):
        llm.generate([[5, 6, 7]], p)


def test_engine_still_serves_after_bad_requests(llm):
    # Rejected requests never reached the ranks: the engine is intact.
    outs = llm.generate([[5, 6, 7], "Hello experts"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert isinstance(outs[1].text, str) and outs[1].prompt_token_ids == llm.tokenizer.encode("Hello experts")


def _read_to_the_end(llm, rid: str) -> tuple[list[int], str]:
    """rid's tokens and finish reason as its submit caller reads them off the outbox (only rid's rows there)."""
    got, finish = [], None
    while finish is None:
        msg = llm.outbox.get(timeout=30)
        for row, toks, finish_reason, *_ in msg[1] if msg[0] == "out" else ():
            assert row == rid
            got += toks
            finish = finish_reason
    return got, finish


def test_stats_while_progress_waits_loses_none_of_it(llm):
    """stats() reads the outbox for its answer: the progress of a submitted request read on the way is put back
    for the caller (it was dropped: the request never finished for its reader)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    want = llm.generate([[5, 6, 7]], params)[0].token_ids
    rid = llm.submit([5, 6, 7], params)
    first = llm.outbox.get(timeout=30)
    llm.outbox.put_back([first])       # its outputs are on the outbox before stats() asks
    assert llm.stats()["steps"] > 0
    assert _read_to_the_end(llm, rid) == (want, "length")


def test_generate_leaves_a_submitted_requests_progress_to_its_reader(llm):
    """generate() reads the outbox for its own requests; a submit()ted request's progress read on the way is put
    back for its reader (it was dropped)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    want = llm.generate([[5, 6, 7]], params)[0].token_ids
    rid = llm.submit([5, 6, 7], params)
    assert llm.generate([[8, 9]], params)[0].token_ids == llm.generate([[8, 9]], params)[0].token_ids
    assert _read_to_the_end(llm, rid) == (want, "length")


def test_stats_from_another_thread_while_generate_runs(llm):
    """A monitoring thread's stats() while the main thread's generate() reads the outbox: generate() keeps the
    answer it reads for stats(), which returns while generate() still runs (it held the answer until it returned,
    and a generate() longer than a minute made stats() time out and stop every rank)."""
    params = SamplingParams(max_tokens=llm.max_model_len - 3, ignore_eos=True)
    outs = []
    running = threading.Thread(target=lambda: outs.append(llm.generate([[5 + i, 6, 7] for i in range(8)], params)))
    running.start()
    time.sleep(0.5)                                  # generate() is reading the outbox by now
    stats = llm.stats()
    assert running.is_alive() and stats["num_running"] > 0
    running.join(timeout=120)
    assert not running.is_alive() and [len(o.token_ids) for o in outs[0]] == [params.max_tokens] * 8
    with pytest.raises(queue.Empty):
        llm.outbox.get(timeout=0.5)                  # nothing left behind on the outbox


def test_an_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    """An interrupt (or any error) inside generate() aborts its requests in the engine and drops their progress,
    so later calls neither wait behind them nor read it."""
    real_poll, calls = llm._poll, []

    def interrupted(q, deadline, what):
        calls.append(what)
        if what == "generate" and len(calls) == 1:
            time.sleep(0.3)                            # the request is running by now
            raise KeyboardInterrupt
        return real_poll(q, deadline, what)

    monkeypatch.setattr(llm, "_poll", interrupted)
    long = SamplingParams(max_tokens=llm.max_model_len - 3, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [5, 6]], [long, SamplingParams(max_tokens=long.max_tokens, ignore_eos=True, n=2)])
    monkeypatch.setattr(llm, "_poll", real_poll)
    llm.stats()     # reads the outbox up to its answer: the tokens it passes on the way are not put back
    later = []
    with contextlib.suppress(queue.Empty):
        while True:
            later.append(llm.outbox.get(timeout=0.5))
    assert not any(toks for msg in later if msg[0] == "out" for _, toks, *_ in msg[1]), later
    llm.outbox.put_back(later)                      # (the aborts' rows, for the LLM to read)
    outs = llm.generate([[8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(outs[0].token_ids) == 3
    assert llm.stats()["num_running"] == 0          # aborted: not decoding on to max_model_len
    with pytest.raises(queue.Empty):
        llm.outbox.get(timeout=0.5)                 # and nothing of it was put back
    assert not llm._abandoned                       # each sample's abort row read: nothing left to drop


@pytest.mark.parametrize("expert_ranks,victim,message", [
    (2, 0, "rank 0 died"),                                    # the leader: the single point of failure
    (1, 1, r"every expert rank died \(ranks \[1\]\)"),       # no survivor can take the experts
])
def test_crashed_rank_that_cannot_be_survived_fails_fast(tiny_checkpoint, expert_ranks, victim, message):
    """Losing the leader, or the last expert rank, ends the job within seconds, names why, leaves no process
    behind. (Ranks the job can lose are tests/launch/runtime/test_elastic.py's.)"""
    llm = LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=1, expert_ranks=expert_ranks)
    pids = llm.worker_pids
    killed_at = []

    def kill():
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pids[victim], 9)

    threading.Thread(target=kill, daemon=True).start()
    prompts = [[5 + i, 6, 7] for i in range(32)]
    with pytest.raises(RuntimeError, match=message):
        for _ in range(100):        # a round the machine finishes before the kill lands is followed by another
            llm.generate(prompts, SamplingParams(max_tokens=400, ignore_eos=True))
    assert killed_at and time.monotonic() - killed_at[0] < 10
    assert not any(alive(p) for p in pids), "orphan rank processes remain"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1]])


def test_idle_engine_outlives_collective_timeout(tiny_checkpoint):
    # The idle leader heartbeats, so no rank sits in a collective longer than the (short) timeout.
    with LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=1, expert_ranks=2, collective_timeout_s=2,
             heartbeat_s=0.25) as llm:
        time.sleep(5)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_shm_transport_refused_across_nodes(tiny_checkpoint):
    with pytest.raises(RuntimeError, match="transport='shm' needs every rank on one"):
        LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=1, expert_ranks=1, transport="shm", ranks_per_node=1)
    with pytest.raises(ValueError, match="transport='nvlink' is invalid"):
        LLM(tiny_checkpoint("qwen3_moe"), transport="nvlink")


def test_ranks_die_with_the_process_that_started_them(tmp_path):
    """Ranks are forks of the fork server (launch/procs.py, rank_context), not children of the process that built
    the LLM, yet a SIGKILL of that process takes them down: the server exits once no rank holds its "alive"
    pipe, and each rank's parent-death signal fires. (Ranks that kept the pipe, as forks do, outlived it.)"""
    import subprocess
    import sys
    import textwrap

    from launch.local_server import ROOT
    script = tmp_path / "starter.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from launch import LLM
        from models import SHIPPED_MODEL
        if __name__ == "__main__":
            llm = LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1, load_progress=False)
            print(" ".join(map(str, llm.worker_pids)), flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(map(alive, pids))
        parents = []
        for p in pids:
            with open(f"/proc/{p}/stat") as f:
                parents.append(int(f.read().rsplit(")", 1)[1].split()[1]))
        assert proc.pid not in parents, (proc.pid, parents)     # forks of the server
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(alive, pids)), [p for p in pids if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
