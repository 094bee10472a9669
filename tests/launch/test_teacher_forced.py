"""Teacher-forced logits of the disaggregated forward (real ranks, real dispatch/combine) are within
1e-4 of transformers in fp32, and each rank reads only the tensors it owns."""
from __future__ import annotations

import pytest
import torch

from models.tiny import ARCHS
from tests.conftest import hf_model, make_prompts, wider
from tests.dist_utils import run_ranks


def _rank_fn(rank, world, path, num_attention_ranks, prompt):
    from attention_nodes.batch import ForwardBatch
    from attention_nodes.sampling_params import SamplingParams
    from attention_nodes.sequence import Sequence
    from launch.config import EngineConfig
    from launch.runtime import Runtime

    cfg = EngineConfig.from_options(path, num_attention_ranks, world - num_attention_ranks,
                                    max_num_batched_tokens=1024, micro_batches=1)
    rt = Runtime(cfg)
    logits = None
    if rt.topo.is_attention:
        w = rt.worker
        if rank == 0:  # rank 0 runs the prompt; other attention ranks join with zero tokens
            w.scheduler.add(Sequence.from_request("r", prompt, SamplingParams(), 1))
            batch = ForwardBatch.from_scheduled(w.scheduler.schedule().scheduled, w.kv.block_size, w.device)
            batch.logit_rows = torch.arange(len(prompt))
        else:
            batch = ForwardBatch.empty(w.device)
        w.moe.dispatcher.set_capacity(len(prompt))
        logits = w.model.forward([batch], w.kv, w.moe)
    else:
        rt.worker.step(len(prompt))
    return {"logits": logits, "names": list(rt.ckpt.names_read), "role": rt.topo.role}


# CI: one of each attention kind (GQA with q/k norm, MLA with a dense layer, sinks and windows); the rest in
# the wider matrix.
@pytest.mark.parametrize("arch", [a if a in ("qwen3_moe", "deepseek_v3", "gpt_oss") else wider(a) for a in ARCHS])
def test_teacher_forced_logits(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    prompt = make_prompts(1, 256, 37, 37, seed=3)[0]
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([prompt])).logits[0]
    results = run_ranks(_rank_fn, 4, path, 2, prompt)
    torch.testing.assert_close(results[0]["logits"], expected, atol=1e-4, rtol=0)
    assert results[1]["logits"].shape == (0, expected.shape[1])

    # Weight ownership: attention ranks read every non-expert tensor and no expert; expert rank i
    # reads exactly the experts of its contiguous block, for every MoE layer.
    from models.checkpoint import Checkpoint
    ckpt = Checkpoint(path)
    spec = ckpt.spec
    non_expert = set(ckpt.attention_tensor_names())
    for r in (0, 1):
        assert set(results[r]["names"]) == non_expert
    per_rank = spec.num_experts // 2
    for i, r in enumerate((2, 3)):
        want = {n for layer in spec.moe_layer_ids for e in range(i * per_rank, (i + 1) * per_rank)
                for n in spec.expert_tensor_names(layer, e)}
        assert set(results[r]["names"]) == want
        assert len(results[r]["names"]) == len(want)  # each read once
