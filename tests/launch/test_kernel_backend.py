"""kernel_backend='triton': the whole runtime (attention rank and expert rank) runs the Triton kernels and gives
transformers' greedy tokens. Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1, which the spawned ranks inherit), so the model, ranks and tokens are few."""
from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from launch.config import EngineConfig
from tests.conftest import hf_greedy, make_prompts

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_triton_backend_matches_transformers(tiny_checkpoint, arch):
    """Qwen3-MoE (GQA, fused MoE kernel), DeepSeek-V3 (MLA through the paged kernels with the latent cache as
    K and V), GPT-OSS (sinks and sliding windows in the kernels)."""
    path = tiny_checkpoint(arch)
    # A 40-token prompt over a 24-token budget: its second chunk is a prefill over a cached prefix.
    prompts = make_prompts(3, 256, 2, 12, seed=7) + [make_prompts(1, 256, 40, 40, seed=8)[0]]
    expected = hf_greedy(path, prompts, 4)
    with LLM(path, attention_ranks=1, expert_ranks=1, kernel_backend="triton", max_num_batched_tokens=24) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        stats, comm = llm.stats(), llm.comm_stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["num_prefill_chunks"] > 0
    assert {r: v["kernel_backend"] for r, v in comm["ranks"].items()} == {"0": "triton", "1": "triton"}


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig.from_options(str(tmp_path), 1, 1, kernel_backend="triton", device="cpu")
    with pytest.raises(ValueError, match="'cuda'"):
        EngineConfig.from_options(str(tmp_path), 1, 1, kernel_backend="cuda")
