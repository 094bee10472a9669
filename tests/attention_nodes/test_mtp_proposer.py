"""attention_nodes/mtp.py, in one process: an attention worker whose routed experts are computed locally steps
through chunked prefills and speculative decode steps, and after every step each sequence's drafts are exactly the
reference MTP forward's (tests/mtp_reference.py, transformers' modules) for its tokens so far; every step serves
the MTP layer's MoE once per pass, and a decode step's passes read nothing back. Small KV blocks put the drafts'
positions across block edges (scratch blocks) and the prompts' chunks across several steps."""
from __future__ import annotations

import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from attention_nodes.block_pool import BlockPool
from attention_nodes.kv_cache import KVCache
from attention_nodes.model import AttentionModel
from attention_nodes.mtp import MTPProposer
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.speculation import SpeculativeConfig
from attention_nodes.worker import AttentionWorker
from comm.stats import CommStats
from expert_nodes.slots import ExpertSlots
from models.checkpoint import Checkpoint
from models.tiny import make_tiny_mtp_checkpoint
from tests.conftest import hf_greedy, make_prompts, wider
from tests.host_reads import no_host_reads
from tests.mtp_reference import ReferenceMTP

K, BS, MAX_NEW = 3, 4, 12


class LocalExperts:
    """What the forward needs of an MoEContext, with every routed expert computed here (ExpertSlots holding all
    of them, slot = expert); `layers` records the MoE layers served, in order."""

    def __init__(self, ckpt: Checkpoint):
        spec = ckpt.spec
        everyone = torch.arange(spec.num_experts).repeat(spec.num_moe_layers, 1)
        self.slots = ExpertSlots.load(ckpt, everyone, torch.float32, torch.device("cpu"))
        self.dispatcher = SimpleNamespace(stats=CommStats(), set_capacity=lambda capacity: None)
        self.layers: list[int] = []
        self.waited_s = 0.0

    def start(self, moe_layer, x, ids, weights):
        self.layers.append(moe_layer)
        return self.slots.ffn(moe_layer, x, ids, weights)

    def finish(self, pending):
        return pending


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_mtp_checkpoint(tmp_path_factory.mktemp("mtp"), seed=0)


def _worker(path: str, backend: str = "torch") -> tuple[AttentionWorker, LocalExperts]:
    ckpt = Checkpoint(path, mtp=True)
    spec, cpu = ckpt.spec, torch.device("cpu")
    model = AttentionModel(spec, ckpt.read(ckpt.attention_tensor_names(), torch.float32), cpu, backend)
    num_blocks, max_len = 96, 128
    kv = KVCache(spec.num_layers, num_blocks, BS, spec.kv_entry, torch.float32, cpu)
    pool = BlockPool(num_blocks, BS)
    sched = Scheduler(pool, 8, 16, enable_prefix_caching=False)    # 16-token budget: prompts take several steps
    mtp = MTPProposer(model, num_blocks, BS, 8, K, torch.float32, cpu, lambda b: pool.refcount(b) == 1)
    moe = LocalExperts(ckpt)
    config = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": K})
    return AttentionWorker(0, model, kv, sched, moe, max_len, cpu, 1, config, None, mtp), moe


@pytest.mark.parametrize("backend", ["torch", wider("triton")])   # Triton under the interpreter: ~27 s
def test_each_steps_drafts_are_the_reference_layers(checkpoint, tmp_path, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    reference = ReferenceMTP(checkpoint, os.fspath(tmp_path / "layer"))
    prompts = make_prompts(4, 256, 5, 30, seed=22)
    expected = hf_greedy(checkpoint, prompts, MAX_NEW)
    worker, moe = _worker(checkpoint, backend)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True).to_dict()
    worker.add_requests([{"id": str(i), "prompt": p, "params": params} for i, p in enumerate(prompts)])
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    checked = moe_layers = decode_steps = 0
    for step in range(1, 60):
        if not worker.scheduler.has_work:
            break
        moe.layers.clear()
        worker.started_step = step
        worker.last_report = worker.step(capacity=64)
        # a decode step's passes read nothing back (the drafts stay on the device); a prompt chunk's prefill rows
        # take the torch backend's prefill path, which reads its chunk bounds
        with no_host_reads() if worker.is_decode_step else nullcontext():
            report = worker.draft(K)
        decode_steps += worker.is_decode_step
        for rid, toks, *_ in report.outputs:
            outputs[rid] += toks
        moe_layers = moe.layers[-K:]
        for seq in worker.scheduler.running:
            if seq.spec_tokens:
                assert seq.spec_tokens.read() == reference.drafts(seq.token_ids, len(seq.spec_tokens)), \
                    (step, seq.request_id)
                checked += 1
    assert [outputs[str(i)] for i in range(len(prompts))] == expected
    # the MTP layer is MoE layer 2, after the target's 0 and 1
    assert checked > 10 and decode_steps > 3 and moe_layers == [2] * K


def test_a_checkpoint_with_two_mtp_layers_runs_its_first(tmp_path):
    """DeepSeek's depth-2 module reads depth 1's outputs at every position, which the passes do not compute: only the
    first MTP layer runs, its drafts still the reference's, and the second layer's tensors are never read."""
    path = make_tiny_mtp_checkpoint(tmp_path / "two", seed=3, num_mtp_layers=2)
    ckpt = Checkpoint(path, mtp=True)
    assert ckpt.spec.num_mtp_layers == 1 and not any(".layers.4." in n for n in ckpt.attention_tensor_names())
    reference = ReferenceMTP(path, os.fspath(tmp_path / "layer"))
    worker, _ = _worker(path)
    params = SamplingParams(max_tokens=8, ignore_eos=True).to_dict()
    worker.add_requests([{"id": "0", "prompt": make_prompts(1, 256, 9, 9, seed=4)[0], "params": params}])
    checked = 0
    for step in range(1, 12):
        worker.started_step = step
        worker.last_report = worker.step(capacity=64)
        worker.draft(K)
        for seq in worker.scheduler.running:
            if seq.spec_tokens:
                assert seq.spec_tokens.read() == reference.drafts(seq.token_ids, len(seq.spec_tokens))
                checked += 1
    assert checked >= 2
