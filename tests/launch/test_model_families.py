"""DeepSeek-V2/V3, GLM-4.5 and GPT-OSS beyond the shared fidelity suites (test_teacher_forced,
test_generate_oracle): FP8 block-scaled checkpoints with an MTP layer, MXFP4 experts, the latent KV cache's
size, two-phase comm and live expert moves with replicas, and the refusal of architectures the runtime cannot
run."""
from __future__ import annotations

import io
import json
import os

import pytest
import torch

from launch import LLM, SamplingParams
from models.tiny import quantize_fp8_checkpoint, quantize_mxfp4_checkpoint
from tests.conftest import hf_greedy, hf_model, make_prompts, wider
from tests.dist_utils import run_ranks
from tests.launch.test_teacher_forced import _rank_fn

MAX_NEW = 10


@pytest.mark.parametrize("arch", [wider("deepseek_v2"), "deepseek_v3", wider("glm4_moe"), "gpt_oss"])
def test_greedy_on_one_attention_two_expert_ranks(tiny_checkpoint, arch):
    """1+2 ranks (the shared suite runs 1+1, 2+2 and 1+3), with a prompt longer than the token budget, in two
    ping-pong micro-batches (asked for: auto picks 1 for three ranks on CI's two cores)."""
    path = tiny_checkpoint(arch)
    prompts = make_prompts(4, 256, 3, 30, seed=21) + [make_prompts(1, 256, 70, 70, seed=22)[0]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=1, expert_ranks=2, max_num_batched_tokens=48, micro_batches=2) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_deepseek_v2_auto_comm_round_robin_and_preemption(tiny_checkpoint, tmp_path):
    """comm='auto' over two emulated nodes with round_robin replicas, and a KV pool small enough to preempt."""
    path = tiny_checkpoint("deepseek_v2")
    prompts = make_prompts(7, 256, 3, 40, seed=1) + [make_prompts(1, 256, 70, 70, seed=2)[0]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=1, expert_ranks=3, comm="auto", ranks_per_node=2, balancer="round_robin",
             redundant_experts=1, comm_calibration=str(tmp_path / "calib.json"), num_kv_blocks=14,
             max_num_batched_tokens=48, max_num_seqs=8) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["num_preemptions"] > 0 and stats["num_prefill_chunks"] > 0


@pytest.mark.full
def test_chat_over_http_on_glm(tiny_checkpoint, tmp_path):
    """The OpenAI server on a GLM-4.5 checkpoint answers a chat with the greedy text of LLM.generate."""
    import openai

    from launch.local_server import LocalServer
    path = tiny_checkpoint("glm4_moe")
    messages = [{"role": "user", "content": "Hello experts"}]
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        tok = llm.tokenizer
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        want = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    with LocalServer(path, nproc=3, args=["--attention-ranks", "1"]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                               max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == want and want


def test_mixtral_sliding_window_matches_transformers(tiny_checkpoint):
    """Mixtral's window (every layer) is honoured, no longer refused: prompts run past it."""
    path = tiny_checkpoint("mixtral", sliding_window=6)
    prompts = make_prompts(3, 256, 10, 30, seed=31)
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=1, expert_ranks=1, max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_fp8_checkpoint_with_mtp_layer_matches_transformers_on_dequantized_weights(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("deepseek_v3")
    fp8 = quantize_fp8_checkpoint(src, tmp_path / "fp8", block=(16, 16), dequantized=tmp_path / "deq",
                                  mtp_layers=1)
    prompt = make_prompts(1, 256, 37, 37, seed=3)[0]
    with torch.no_grad():
        expected = hf_model(str(tmp_path / "deq"))(torch.tensor([prompt])).logits[0]
        unquantized = hf_model(src)(torch.tensor([prompt])).logits[0]
    assert (unquantized - expected).abs().max() > 1e-2   # FP8 moved the logits: the check below can tell
    results = run_ranks(_rank_fn, 4, fp8, 2, prompt)
    torch.testing.assert_close(results[0]["logits"], expected, atol=1e-4, rtol=0)

    from safetensors import safe_open
    with safe_open(os.path.join(fp8, "model.safetensors"), "pt") as f:
        stored = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert stored["model.layers.1.self_attn.kv_b_proj.weight"] == "F8_E4M3"
    assert stored["model.layers.1.mlp.experts.0.gate_proj.weight"] == "F8_E4M3"
    mtp = {n for n in stored if n.startswith("model.layers.3.")}
    assert mtp
    for r in results:
        read = set(r["names"])
        assert not read & mtp, f"a {r['role']} rank read MTP tensors"
        scales = {n for n in read if n.endswith("_scale_inv")}
        weights = {n[:-len("_scale_inv")] for n in scales}
        assert scales and weights <= read        # each scale read with its weight
    expert_reads = set(results[2]["names"])
    assert "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv" in expert_reads


def test_mxfp4_experts_match_transformers_on_dequantized_weights(tiny_checkpoint, tmp_path):
    """GPT-OSS's released expert format; expert ranks read only their own experts' rows of the packed tensors."""
    src = tiny_checkpoint("gpt_oss")
    packed = quantize_mxfp4_checkpoint(src, tmp_path / "mxfp4", dequantized=tmp_path / "deq")
    prompt = make_prompts(1, 256, 37, 37, seed=3)[0]      # longer than the 8-token window
    with torch.no_grad():
        expected = hf_model(str(tmp_path / "deq"))(torch.tensor([prompt])).logits[0]
        unquantized = hf_model(src)(torch.tensor([prompt])).logits[0]
    assert (unquantized - expected).abs().max() > 1e-2
    results = run_ranks(_rank_fn, 4, packed, 2, prompt)
    torch.testing.assert_close(results[0]["logits"], expected, atol=1e-4, rtol=0)
    for i, r in enumerate(results[2:]):      # expert rank i holds experts 4i..4i+3 of every layer
        read = set(r["names"])
        assert f"model.layers.0.mlp.experts.gate_up_proj_blocks[{4 * i}]" in read
        assert f"model.layers.3.mlp.experts.down_proj_scales[{4 * i + 3}]" in read
        others = {f"[{e}]" for e in range(8) if e // 4 != i}
        assert not any(n[n.index("["):] in others for n in read), "an expert rank read another rank's expert"
    assert not any(".experts." in n for n in results[0]["names"])


def test_gpt_oss_live_expert_moves_carry_biases(tiny_checkpoint):
    """least_loaded with replicas and re-placements every 2 steps: moved slots bring their biases along."""
    path = tiny_checkpoint("gpt_oss")
    prompts = make_prompts(8, 256, 3, 40, seed=11)
    expected = hf_greedy(path, prompts, 12)
    with LLM(path, attention_ranks=2, expert_ranks=3, balancer="least_loaded", redundant_experts=3,
             rebalance_interval=2, max_num_batched_tokens=64) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        stats = llm.comm_stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["replacements"] >= 2 and stats["slots_moved"] > 0


def test_fp8_scale_shape_mismatch_names_the_tensor(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    from models.checkpoint import Checkpoint
    fp8 = quantize_fp8_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path / "fp8", block=(16, 16))
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    bad = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[bad] = tensors[bad][:, :1].contiguous()
    save_file(tensors, path)
    with pytest.raises(ValueError, match="o_proj.weight.*weight_scale_inv has shape"):
        Checkpoint(fp8).read(["model.layers.0.self_attn.o_proj.weight"])


def test_load_progress_bar_counts_the_bytes_read(tiny_checkpoint):
    from models.checkpoint import Checkpoint
    ckpt = Checkpoint(tiny_checkpoint("deepseek_v3"))
    names = ckpt.attention_tensor_names()
    stream = io.StringIO()
    out = ckpt.read(names, progress=stream, desc="rank 0")
    total = sum(t.numel() * t.element_size() for t in out.values())   # fp32 checkpoint, read as stored
    text = stream.getvalue()
    assert "loading weights rank 0" in text and "100%" in text
    from tqdm import tqdm
    done = tqdm.format_sizeof(total)
    assert f"{done}/{done}" in text, text


@pytest.mark.parametrize("arch,expected", [("deepseek_v3", lambda c: (c.kv_lora_rank + c.qk_rope_head_dim) * 4),
                                           ("glm4_moe", lambda c: 2 * c.num_key_value_heads * c.head_dim * 4)])
def test_stats_report_kv_bytes_per_token(tiny_checkpoint, arch, expected):
    """MLA caches one latent entry per token, not per-head K and V."""
    path = tiny_checkpoint(arch)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        stats = llm.stats()
    assert stats["kv_bytes_per_token_per_layer"] == expected(cfg)


def test_kv_bytes_per_token_at_real_scale():
    """DeepSeek-V3 in bf16: (512 + 64) * 2 bytes per token per layer, 1/71 of what its 128 heads would take
    with per-head K (192) and V (128)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig

    from models.spec import spec_from_hf_config
    v3 = spec_from_hf_config(DeepseekV3Config())
    assert v3.kv_bytes_per_token(torch.bfloat16) == (512 + 64) * 2
    glm = spec_from_hf_config(Glm4MoeConfig())
    assert glm.kv_bytes_per_token(torch.bfloat16) == 2 * glm.num_kv_heads * glm.head_dim * 2


@pytest.mark.parametrize("arch,balancer", [wider("deepseek_v3", "least_loaded"), ("glm4_moe", "random"),
                                           ("gpt_oss", "least_loaded")])
def test_two_phase_with_replicated_experts_matches_transformers(tiny_checkpoint, arch, balancer):
    """Two emulated nodes, a replica choice among redundant experts, 2 micro-batches, chunked."""
    path = tiny_checkpoint(arch)
    prompts = make_prompts(6, 256, 2, 30, seed=6) + [make_prompts(1, 256, 60, 60, seed=8)[0]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=2, expert_ranks=2, comm="two_phase", ranks_per_node=2,
             balancer=balancer, redundant_experts=2, max_num_batched_tokens=40, micro_batches=2,
             micro_batch_min_tokens=0) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["num_prefill_chunks"] > 0


@pytest.mark.parametrize("model_type,named", [("qwen3_next", "linear-attention"),
                                              ("deepseek_v32", "indexer")])
def test_unsupported_architecture_is_refused_by_name(tmp_path, model_type, named):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ValueError, match=rf"model_type '{model_type}'.*not supported.*{named}.*supported: .*"
                                         rf"deepseek_v3"):
        LLM(str(tmp_path), attention_ranks=1, expert_ranks=1)
