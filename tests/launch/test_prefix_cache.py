"""Prefix caching, cache-aware routing and the host KV tier, through the whole engine, against transformers."""
from __future__ import annotations

import pytest
from conftest import hf_greedy, make_prompts

from launch.llm import LLM, SamplingParams

MAX_NEW = 6
BS = 4
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def shared_prefix_prompts(prefix_len: int, n: int, seed: int) -> tuple[list[int], list[list[int]]]:
    prefix = make_prompts(1, 256, prefix_len, prefix_len, seed=seed)[0]
    tails = make_prompts(n, 256, 3, 9, seed=seed + 1)
    return prefix, [prefix + t for t in tails]


def cached_tokens(prefix_len: int, prompt_len: int) -> int:
    """What a later prompt can reuse of a cached prefix: whole blocks, never its own last token."""
    return min(prefix_len // BS, (prompt_len - 1) // BS) * BS


def test_hits_are_counted_and_skip_exactly_their_prefill(tiny_checkpoint):
    """A first request caches a 23-token prefix; 4 prompts sharing it then run chunked (budget 12). The hit
    counter rises by each one's cached whole blocks, the prompt tokens computed fall by exactly as many, and the
    tokens are transformers'. Then: an aborted request's blocks serve the next prompt, and a prompt whose every
    block is cached (16 tokens, 4 blocks) recomputes its last block and still gives transformers' tokens."""
    path = tiny_checkpoint("qwen3_moe")
    prefix, prompts = shared_prefix_prompts(23, 5, seed=11)
    first, rest = prompts[0], prompts[1:]
    whole = make_prompts(1, 256, 16, 16, seed=3)[0]
    expected = hf_greedy(path, prompts + [whole], MAX_NEW)
    with LLM(path, attention_ranks=1, expert_ranks=2, block_size=BS, max_num_batched_tokens=12) as llm:
        warm = llm.generate([first], PARAMS)
        before = llm.stats()
        outs = llm.generate(rest, PARAMS)
        after = llm.stats()
        rid = llm.enqueue(whole, SamplingParams(max_tokens=200, ignore_eos=True))
        while not any(r == rid and toks for r, toks, *_ in llm.outbox.get(timeout=60)[1]):
            pass     # its prompt is computed (and its blocks registered) once it has a token
        llm.inbox.put(("abort", rid))
        again = [llm.generate([whole], PARAMS)[0].token_ids for _ in range(2)]
        last = llm.stats()
    assert [o.token_ids for o in warm + outs] == expected[:5]
    assert again == [expected[5]] * 2
    # each output says how many of its prompt tokens it found cached (vLLM's RequestOutput.num_cached_tokens)
    assert [o.num_cached_tokens for o in warm + outs] == [0] + [cached_tokens(len(prefix), len(p)) for p in rest]
    assert before["prefix_cache_hits"] == 0 and before["prefix_cache_queries"] == len(first)
    hits = after["prefix_cache_hits"]
    assert hits == sum(cached_tokens(len(prefix), len(p)) for p in rest) > 0
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == sum(len(p) for p in rest)
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == sum(len(p) for p in rest) - hits
    assert after["num_prefill_chunks"] > 0
    assert last["prefix_cache_hits"] - hits == 2 * 12           # 3 of the 4 blocks, twice
    assert last["prompt_tokens_computed"] - after["prompt_tokens_computed"] == 16 + 2 * 4


@pytest.mark.parametrize("on", [True, False])
def test_tokens_with_cache_on_and_off_under_preemption(tiny_checkpoint, on):
    """A 16-block pool that forces preemption and a 12-token budget that chunks: transformers' tokens either way
    (with caching on, a preempted request also finds its own blocks again)."""
    path = tiny_checkpoint("qwen3_moe")
    _, prompts = shared_prefix_prompts(19, 6, seed=21)
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=1, expert_ranks=1, block_size=BS, num_kv_blocks=16, max_num_batched_tokens=12,
             enable_prefix_caching=on) as llm:
        outs = llm.generate(prompts[:1], PARAMS) + llm.generate(prompts[1:], PARAMS)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["num_preemptions"] > 0
    assert (stats["prefix_cache_hits"] > 0) == on
    # a recompute after preemption finds the sequence's own blocks: those are not counted as the request's hits
    assert [o.num_cached_tokens for o in outs] == [0] + [cached_tokens(19, len(p)) * on for p in prompts[1:]]
    assert sum(o.num_cached_tokens for o in outs) < stats["prefix_cache_hits"] or not on


def test_repeated_prefix_is_routed_to_the_rank_that_caches_it(tiny_checkpoint):
    """Two attention ranks. X and Y go to ranks 0 and 1 (most free blocks). Then Y2 and X2, sharing Y's and X's
    prefixes, arrive in that order: most-free routing would send Y2 to rank 0 and X2 to rank 1, where neither
    prefix is; cache-aware routing swaps them, so both hit."""
    path = tiny_checkpoint("qwen3_moe")
    px, (x, x2) = shared_prefix_prompts(18, 2, seed=31)
    py, (y, y2) = shared_prefix_prompts(21, 2, seed=41)
    expected = hf_greedy(path, [x, y, y2, x2], MAX_NEW)
    with LLM(path, attention_ranks=2, expert_ranks=1, block_size=BS) as llm:
        outs = llm.generate([x, y], PARAMS) + llm.generate([y2, x2], PARAMS)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["num_routed_to_cache"] == 2
    assert stats["prefix_cache_hits"] == cached_tokens(len(px), len(x2)) + cached_tokens(len(py), len(y2)) > 0


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt(tiny_checkpoint):
    """vLLM's cache_salt: a prompt cached under salt "a" is found again under "a" only, not under "b" nor unsalted,
    and the unsalted one's blocks are found unsalted only; the tokens are transformers' every time."""
    path = tiny_checkpoint("qwen3_moe")
    prompt = make_prompts(1, 256, 17, 17, seed=51)[0]          # 4 whole blocks before its last token
    expected = hf_greedy(path, [prompt], MAX_NEW)[0]
    hits, reported = [], []
    with LLM(path, attention_ranks=1, expert_ranks=1, block_size=BS) as llm:
        for salt in ("a", "b", None, "a", None):
            before = llm.stats()["prefix_cache_hits"]
            out = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, cache_salt=salt))[0]
            assert out.token_ids == expected, salt
            hits.append(llm.stats()["prefix_cache_hits"] - before)
            reported.append(out.num_cached_tokens)
        # two samples of one request: its prompt counted once; prompt logprobs score every position, so none
        two = llm.generate([prompt], SamplingParams(max_tokens=2, n=2, ignore_eos=True, cache_salt="a"))[0]
        scored = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0, cache_salt="a"))[0]
    assert hits == reported == [0, 0, 0, 16, 16]
    assert (len(two.samples), two.num_cached_tokens, scored.num_cached_tokens) == (2, 16, 0)
    with pytest.raises(ValueError, match=r"SamplingParams\.cache_salt=''"):
        SamplingParams(cache_salt="")


def test_blocks_evicted_to_the_host_tier_are_restored_not_recomputed(tiny_checkpoint):
    """A 12-block device pool and a host tier. A's blocks are evicted by a prompt that fills the whole pool, so
    they live only on the host; A2 (A's prefix plus another tail) then restores them by copy: the restored count
    equals its cached blocks, the prompt tokens computed fall by as many tokens, and the tokens are
    transformers'."""
    path = tiny_checkpoint("qwen3_moe")
    prefix, (a, a2) = shared_prefix_prompts(22, 2, seed=51)
    filler = make_prompts(1, 256, 44, 44, seed=52)[0]
    expected = hf_greedy(path, [a, a2], MAX_NEW)
    with LLM(path, attention_ranks=1, expert_ranks=1, block_size=BS, num_kv_blocks=12,
             kv_offload_memory=1 << 20) as llm:
        out_a = llm.generate([a], PARAMS)[0].token_ids
        llm.generate([filler], SamplingParams(max_tokens=4, ignore_eos=True))
        before = llm.stats()
        out_a2 = llm.generate([a2], PARAMS)[0]
        after = llm.stats()
    assert [out_a, out_a2.token_ids] == expected
    hit = cached_tokens(len(prefix), len(a2))
    assert before["kv_offload_saved_blocks"] >= len(a) // BS and before["kv_offload_restored_blocks"] == 0
    assert after["kv_offload_restored_blocks"] == hit // BS > 0
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == hit
    assert out_a2.num_cached_tokens == hit      # restored from the host tier: cached, not computed
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(a2) - hit


def test_host_tier_needs_the_prefix_cache_and_room_for_a_block(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"kv_offload_memory=4096 needs prefix caching"):
        LLM(path, attention_ranks=1, expert_ranks=1, enable_prefix_caching=False, kv_offload_memory=4096)
    with pytest.raises(RuntimeError, match=r"kv_offload_memory=10 bytes holds no KV block"):
        LLM(path, attention_ranks=1, expert_ranks=1, kv_offload_memory=10).close()


def test_reset_prefix_cache_forgets_every_ranks_cache_and_the_leaders_view(tiny_checkpoint):
    """vLLM's LLM.reset_prefix_cache, two attention ranks: X and Y cached on ranks 0 and 1, a long request running.
    After the reset X2 and Y2 (sharing X's and Y's prefixes) find nothing cached and are not routed by the
    forgotten caches; the running request ends with transformers' tokens; what runs after the reset is cached
    again."""
    path = tiny_checkpoint("qwen3_moe")
    px, (x, x2) = shared_prefix_prompts(18, 2, seed=31)
    py, (y, y2) = shared_prefix_prompts(21, 2, seed=41)
    long = make_prompts(1, 256, 10, 10, seed=43)[0]
    expected = hf_greedy(path, [x, y, y2, x2], MAX_NEW)
    want_long = hf_greedy(path, [long], 200)[0]
    with LLM(path, attention_ranks=2, expert_ranks=1, block_size=BS) as llm:
        first = llm.generate([x, y], PARAMS)
        rid = llm.enqueue(long, SamplingParams(max_tokens=200, ignore_eos=True))
        got, ended = [], []

        def read() -> None:
            for r, toks, finish, *_ in llm.outbox.get(timeout=60)[1]:
                if r == rid:
                    got.extend(toks)
                    ended.extend([finish] if finish is not None else [])
        while not got:       # running: it has its first token
            read()
        before = llm.stats()
        assert llm.reset_prefix_cache() is True
        after = llm.generate([y2, x2], PARAMS)
        stats = llm.stats()
        assert not ended and stats["num_running"] >= 1      # it ran through the reset
        llm.inbox.put(("abort", rid))
        while not ended:
            read()
        again = llm.generate([x2], PARAMS)[0]
        with pytest.raises(ValueError, match="reset_connector=True: this engine has no KV connector"):
            llm.reset_prefix_cache(reset_connector=True)
    assert [o.token_ids for o in first + after] == expected
    assert ended == ["abort"] and 0 < len(got) < 200 and got == want_long[:len(got)]
    assert [o.num_cached_tokens for o in after] == [0, 0]
    assert stats["prefix_cache_hits"] == before["prefix_cache_hits"]
    assert stats["num_routed_to_cache"] == before["num_routed_to_cache"]
    assert again.num_cached_tokens == cached_tokens(len(x2), len(x2)) > 0


def test_reset_prefix_cache_empties_the_host_tier(tiny_checkpoint):
    """A's blocks evicted to the host tier (as above) are not restored after a reset: A2 computes its whole
    prompt."""
    path = tiny_checkpoint("qwen3_moe")
    prefix, (a, a2) = shared_prefix_prompts(22, 2, seed=51)
    filler = make_prompts(1, 256, 44, 44, seed=52)[0]
    with LLM(path, attention_ranks=1, expert_ranks=1, block_size=BS, num_kv_blocks=12,
             kv_offload_memory=1 << 20) as llm:
        llm.generate([a], PARAMS)
        llm.generate([filler], SamplingParams(max_tokens=4, ignore_eos=True))
        before = llm.stats()
        llm.reset_prefix_cache()
        out = llm.generate([a2], PARAMS)[0]
        after = llm.stats()
    assert out.token_ids == hf_greedy(path, [a2], MAX_NEW)[0]
    assert before["kv_offload_saved_blocks"] >= len(a) // BS
    assert after["kv_offload_restored_blocks"] == before["kv_offload_restored_blocks"] == 0
    assert out.num_cached_tokens == 0
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(a2)


TORCHRUN_SCRIPT = """
import json, sys
from launch import LLM, SamplingParams
path, prompt = sys.argv[1], json.loads(sys.argv[2])
params = SamplingParams(max_tokens=4, ignore_eos=True)
llm = LLM(path, attention_ranks=2, expert_ranks=1, block_size=4)    # every rank constructs it and calls each method
cached = [llm.generate([prompt], params), llm.generate([prompt], params)]
reset = llm.reset_prefix_cache()
cached.append(llm.generate([prompt], params))
if llm.is_leader:
    print("RESULT", json.dumps({"reset": reset, "cached": [o[0].num_cached_tokens for o in cached],
                                "tokens": [o[0].token_ids for o in cached]}))
else:
    assert reset is False and cached == [[], [], []]
llm.shutdown()
"""


def test_reset_prefix_cache_under_torchrun(tiny_checkpoint, tmp_path):
    """Under torchrun every rank calls reset_prefix_cache, as generate: the leader gets True, the others False, and
    the prompt cached before it is not found after it (2+1 ranks)."""
    import json
    import os
    import subprocess
    import sys

    from launch.procs import free_port
    path = tiny_checkpoint("qwen3_moe")
    prompt = make_prompts(1, 256, 14, 14, seed=61)[0]
    script = tmp_path / "reset.py"
    script.write_text(TORCHRUN_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                           str(free_port()), str(script), path, json.dumps(prompt)], capture_output=True, text=True,
                          timeout=240, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT "):])
    assert got["reset"] is True
    assert got["cached"] == [0, cached_tokens(len(prompt), len(prompt)), 0] and got["cached"][1] > 0
    assert got["tokens"] == [hf_greedy(path, [prompt], 4)[0]] * 3
