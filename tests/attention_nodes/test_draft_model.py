"""attention_nodes/draft_model.py: the draft's proposals are transformers' own greedy continuation of the draft
checkpoint, step after step while the sequences grow (by tokens that are not the draft's), with its KV kept in the
target's full blocks and the tails in scratch blocks; a preempted sequence starts again from nothing; a model with
MoE layers is refused."""
from __future__ import annotations

import random

import pytest
import torch

from attention_nodes.block_pool import BlockPool
from attention_nodes.draft_model import DraftModel
from attention_nodes.model import AttentionModel
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence
from attention_nodes.speculation import SpeculativeConfig
from attention_nodes.step_plan import SchedulerOutput
from launch.runtime.sizing import DeviceSettings
from launch.runtime.startup import load_draft_model
from models.checkpoint import Checkpoint
from models.tiny import make_tiny_checkpoint
from tests.conftest import hf_model, make_prompts
from tests.host_reads import no_host_reads

EOS = frozenset({2})
BS = 4


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE config whose two layers are both MLPs: a dense model."""
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("draft"), seed=1, mlp_only_layers=[0, 1])


def load(path: str, backend: str = "torch") -> AttentionModel:
    ckpt = Checkpoint(path)
    return AttentionModel(ckpt.spec, ckpt.read(ckpt.attention_tensor_names(), torch.float32), torch.device("cpu"),
                          backend)


def hf_next(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_proposals_are_the_drafts_greedy_continuation(dense_draft, backend):
    """Three requests, one of which draws two samples (forked: they share the prompt's partly filled last block
    until each copies it on write): every call's proposals equal transformers' greedy continuation of the draft
    from each sequence's tokens, while the sequences grow by tokens that are not the draft's."""
    path = dense_draft
    hf = hf_model(path)
    hf.generation_config.eos_token_id = None
    num_blocks = 40
    sched = Scheduler(BlockPool(num_blocks, BS), max_num_seqs=4, max_num_batched_tokens=64)
    pool = sched.block_pool
    draft = DraftModel(load(path, backend), num_blocks, BS, max_num_seqs=4, k=3, dtype=torch.float32,
                       device=torch.device("cpu"), exclusive=lambda b: pool.refcount(b) == 1)
    prompts = make_prompts(3, 256, 3, 13, seed=5)
    seqs = [Sequence.from_request(f"r{i}", p, SamplingParams(max_tokens=40, n=1 + (i == 1)), i + 1)
            for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    rng = random.Random(0)
    shared_tails = 0
    for step in range(8):
        out = sched.schedule()
        for s in [s for s in out.scheduled if s.seq.needs_fork and s.needs_sample]:
            out.scheduled += sched.fork(s, [None])
        sched.update(out, [rng.randrange(3, 256) if s.needs_sample else None for s in out.scheduled], EOS, 200)
        live = [s for s in sched.running]
        rooms = [rng.randint(1, 3) for _ in live]
        tails = [pool.refcount(s.block_table[(s.num_tokens - 1) // BS]) > 1
                 if (s.num_tokens - 1) // BS < len(s.block_table) else False for s in live]
        shared_tails += sum(tails)
        got = draft.propose(live, rooms).tolist()
        for s, room, d, shared in zip(live, rooms, got, tails):
            assert d[:room] == hf_next(hf, s.token_ids, room), (step, s.request_id, s.num_tokens)
            # the target's blocks hold the draft's KV up to the last token, but for a shared tail
            full = (s.num_tokens - 1) // BS * BS
            assert s.draft_computed == (full if shared or full // BS >= len(s.block_table) else s.num_tokens)
        if step == 4:   # a preempted sequence gives its blocks back and starts from nothing
            victim = sched.running[-1]
            sched._preempt(victim, SchedulerOutput())
            assert victim.draft_computed == 0
    assert shared_tails >= 2      # the two samples' shared tail was met (and its copy on write after)


def test_a_call_reads_nothing_back(dense_draft):
    """Each forward's argmax feeds the next on the device, and the drafts stay there (the next step's batch and
    verification take them from the device: spec_decode.DeviceDrafts)."""
    pool = BlockPool(16, BS)
    draft = DraftModel(load(dense_draft), 16, BS, 4, 3, torch.float32, torch.device("cpu"),
                       exclusive=lambda b: pool.refcount(b) == 1)
    seqs = [Sequence.from_request(f"r{i}", p, SamplingParams(max_tokens=20), i + 1)
            for i, p in enumerate(make_prompts(2, 256, 5, 9, seed=2))]
    for s in seqs:
        s.block_table.extend(pool.allocate(pool.blocks_needed(s.num_tokens)))
    with no_host_reads():
        got = draft.propose(seqs, [3, 1])
    assert tuple(got.shape) == (2, 3) and got.device == torch.device("cpu")


def test_a_draft_with_moe_layers_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="the draft model has 2 MoE layers: pass a dense one"):
        DraftModel(load(tiny_checkpoint("qwen3_moe")), 8, BS, 4, 3, torch.float32, torch.device("cpu"))


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint, tmp_path):
    other = make_tiny_checkpoint("qwen3_moe", tmp_path, vocab_size=400, mlp_only_layers=[0, 1])
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": other, "num_speculative_tokens": 2})
    target = Checkpoint(tiny_checkpoint("qwen3_moe")).spec
    dev = DeviceSettings(torch.device("cpu"), torch.float32, "torch", "gloo")
    with pytest.raises(ValueError, match="has a vocabulary of 400 tokens and the target 320"):
        load_draft_model(cfg, target, dev, 8, BS, 4)
