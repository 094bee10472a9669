"""Priority scheduling (scheduling_policy="priority", vLLM's) through the whole engine, against transformers: the
waiting requests run lowest priority first, a KV pool too small for them all preempts the least urgent, and every
output is transformers' greedy one. Under "fcfs" a priority is refused, over HTTP too (naming the field)."""
from __future__ import annotations

import pytest
from conftest import hf_greedy, make_prompts

from launch.admission import Admission
from launch.llm import LLM, SamplingParams
from tests.launch.frontend.in_process import serving
from tests.launch.frontend.test_http_logprobs import post

MAX_NEW = 5


def test_waiting_requests_run_by_priority_with_transformers_tokens(tiny_checkpoint):
    """One seat: four requests sent together run one at a time, priority 0 first, then 1, 2, 3 (their finishes
    come in that order), whatever order they were sent in. A completion's priority is taken over HTTP."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(4, 256, 5, 9, seed=61)
    priorities = [3, 1, 2, 0]
    expected = hf_greedy(path, prompts, MAX_NEW)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(path, attention_ranks=1, expert_ranks=1, max_num_seqs=1, scheduling_policy="priority") as llm:
        outs = llm.generate(prompts, params, priority=priorities)
        rids = llm.enqueue_all(prompts, [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, priority=p)
                                         for p in priorities])
        finished = []
        while len(finished) < len(rids):
            msg = llm.outbox.get(timeout=60)
            finished += [row[0] for row in msg[1] if row[2] is not None] if msg[0] == "out" else []
        with pytest.raises(ValueError, match=r"2 priorities for 4 prompts"):
            llm.generate(prompts, params, priority=[0, 1])
        with serving(llm, path, "tiny") as (port, _):      # the HTTP field (vLLM's) reaches the engine
            class Served:
                pass
            Served.port = port
            code, got = post(Served, "/v1/completions", {"model": "tiny", "prompt": prompts[0], "priority": -7,
                                                         "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                                                         "return_token_ids": True})
    assert code == 200 and got["choices"][0]["token_ids"] == expected[0], got
    assert [o.token_ids for o in outs] == expected
    assert finished == [rids[i] for i in sorted(range(4), key=priorities.__getitem__)]


def test_a_small_pool_preempts_the_least_urgent_and_outputs_stay_exact(tiny_checkpoint):
    """12 blocks of 4 for eight requests of mixed priority (chunked at 12 tokens): requests are preempted, and
    every output is transformers'."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(8, 256, 6, 14, seed=62)
    priorities = [2, 0, 1, 2, 0, 1, 2, 0]
    expected = hf_greedy(path, prompts, 12)
    with LLM(path, attention_ranks=1, expert_ranks=1, block_size=4, num_kv_blocks=12, max_num_batched_tokens=12,
             scheduling_policy="priority") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), priority=priorities)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["num_preemptions"] > 0


def test_fcfs_refuses_a_priority():
    admission = Admission(None, 100, 4, 64, 64)
    admission.check_priority(SamplingParams(priority=0))
    with pytest.raises(ValueError, match=r"priority=-3 needs scheduling_policy='priority'.*--scheduling-policy"):
        admission.check_priority(SamplingParams(priority=-3))
    Admission(None, 100, 4, 64, 64, scheduling_policy="priority").check_priority(SamplingParams(priority=-3))
    with pytest.raises(ValueError, match=r"SamplingParams.priority=1.5 is invalid"):
        SamplingParams(priority=1.5)
