"""Tiny random checkpoints for tests, the demo and benchmarks, made locally with transformers
(config -> save_pretrained), no network."""
from __future__ import annotations

import os

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")
TINY_VOCAB = 320  # >= 256 byte-level symbols + 3 specials of the tiny tokenizer


def tiny_config(arch: str, **overrides):
    """A small config of the given architecture. initializer_range is large so random logits are well
    separated and greedy decoding is not decided by rounding."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512,
                  initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if arch == "qwen3_moe":
        kw = dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16, norm_topk_prob=True)
        return Qwen3MoeConfig(**{**kw, **common})
    if arch == "qwen2_moe":
        kw = dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                  num_experts=8)
        return Qwen2MoeConfig(**{**kw, **common})
    if arch == "mixtral":
        return MixtralConfig(**{**dict(intermediate_size=32, num_local_experts=8), **common})
    if arch == "olmoe":
        return OlmoeConfig(**{**dict(intermediate_size=32, num_experts=8), **common})
    # DeepSeek / GLM shapes: 3 layers, the first dense, 8 routed experts plus shared ones.
    deep = dict(num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96, moe_intermediate_size=32,
                n_routed_experts=8)
    mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    if arch == "deepseek_v2":   # V2-Lite: no q_lora_rank, softmax greedy routing, 2 shared experts
        kw = dict(deep, **mla, q_lora_rank=None, n_shared_experts=2, topk_method="greedy")
        return DeepseekV2Config(**{**common, **kw, **overrides})
    if arch == "deepseek_v3":   # q_lora_rank, sigmoid routing with bias in 4 groups, YaRN RoPE
        kw = dict(deep, **mla, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                  routed_scaling_factor=2.5, rope_parameters=dict(
                      rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                      mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))
        return DeepseekV3Config(**{**common, **kw, **overrides})
    if arch == "glm4_moe":      # GQA, half-rotary heads, q/k norm, attention bias, V3's router
        kw = dict(deep, head_dim=16, n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=1.5, use_qk_norm=True, attention_bias=True,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
        return Glm4MoeConfig(**{**common, **kw, **overrides})
    if arch == "gpt_oss":       # sinks, sliding window 8 on even layers, clamped SwiGLU, biases, YaRN
        kw = dict(num_hidden_layers=4, head_dim=16, num_local_experts=8, intermediate_size=32, sliding_window=8,
                  swiglu_limit=7.0, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0,
                                                         original_max_position_embeddings=64, beta_fast=32.0,
                                                         beta_slow=1.0, truncate=False))
        return GptOssConfig(**{**common, **kw, **overrides})
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def make_tiny_checkpoint(arch: str, path: str | os.PathLike, seed: int = 0, max_shard_size: str | None = None,
                         with_tokenizer: bool = True, **overrides) -> str:
    """Write a random checkpoint of `arch` (and a tiny tokenizer) to path and return path."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    with torch.no_grad():   # transformers starts these at zero (or one value); make them matter
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias") or (arch == "gpt_oss" and name.endswith(("bias", "sinks"))):
                t.copy_(torch.randn(t.shape) * (1.0 if name.endswith("sinks") else 0.2))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(os.fspath(path), **kwargs)
    if with_tokenizer:
        save_tiny_tokenizer(path, model.config.vocab_size)
    return os.fspath(path)


# A minimal chat format of our own: each message as "<s>role\ncontent</s>\n", then "<s>assistant\n" to answer;
# tools first as a system turn of their JSON, and an assistant turn's calls in Hermes' form after its content.
TINY_CHAT_TEMPLATE = (
    "{% if tools %}<s>system\ntools: {{ tools | tojson }}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def save_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = TINY_VOCAB) -> None:
    """Train a small byte-level BPE tokenizer on local text and save it (with a chat template) beside a tiny
    checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [
        "Mixture-of-experts models route each token to a few experts.",
        "Attention ranks hold the paged KV cache; expert ranks hold the expert weights.",
        "Every layer dispatches tokens to the experts and combines their outputs.",
        "The quick brown fox jumps over the lazy dog. Hello world, hello experts!",
    ] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(os.fspath(path))


# Weights DeepSeek-V3's FP8 release keeps in high precision: embeddings, LM head, norms and the router.
_FP8_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.")


def quantize_fp8_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, block: tuple[int, int] = (16, 16),
                            dequantized: str | os.PathLike | None = None,
                            mtp_layers: int = 0) -> str:
    """Write src's checkpoint to dst in DeepSeek-V3's released FP8 format: every linear weight as float8_e4m3fn
    plus a float32 `weight_scale_inv` `[ceil(out/br), ceil(in/bc)]` (the per-block factor that dequantizes
    it), and a `quantization_config` in config.json. dequantized: also write the checkpoint of exactly the
    weights the FP8 ones stand for (the oracle for transformers). mtp_layers: append that many
    multi-token-prediction layers (copies of the last layer, as the release ships one) that the runtime
    must skip; config.num_nextn_predict_layers says so."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = os.fspath(src), os.fspath(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    br, bc = block
    fp8, plain = {}, {}
    for name, w in tensors.items():
        if w.ndim != 2 or not name.endswith(".weight") or any(k in name for k in _FP8_SKIP):
            fp8[name] = plain[name] = w
            continue
        rows, cols = w.shape
        pad = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc)
        pad[:rows, :cols] = w.float()
        blocks = pad.view(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        fp8[name] = q.view_as(pad)[:rows, :cols].contiguous()
        fp8[name + "_scale_inv"] = scale
        plain[name] = (q.float() * scale[:, None, :, None]).view_as(pad)[:rows, :cols].to(w.dtype).contiguous()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    last = config["num_hidden_layers"] - 1
    for extra in range(mtp_layers):
        prefix, new = f"model.layers.{last}.", f"model.layers.{last + 1 + extra}."
        fp8.update({new + n[len(prefix):]: t.clone() for n, t in list(fp8.items()) if n.startswith(prefix)})
    for out, weights in ((dst, fp8), (dequantized, plain)):
        if out is None:
            continue
        out = os.fspath(out)
        os.makedirs(out, exist_ok=True)
        for fname in os.listdir(src):
            if fname != "model.safetensors" and fname != "config.json":
                shutil.copy(os.path.join(src, fname), out)
        save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config)
        if out == dst:
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [br, bc]}
            cfg["num_nextn_predict_layers"] = mtp_layers
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    return dst


def quantize_mxfp4_checkpoint(src: str | os.PathLike, dst: str | os.PathLike,
                              dequantized: str | os.PathLike | None = None) -> str:
    """Write src's GPT-OSS checkpoint to dst with its expert weights in the released MXFP4 format:
    `experts.gate_up_proj_blocks` `[E, 2I, H/32, 16]` uint8 (two FP4 e2m1 codes per byte, low nibble first) and
    `experts.gate_up_proj_scales` `[E, 2I, H/32]` uint8 (power-of-two exponents biased by 127), the same for
    down_proj, and an mxfp4 `quantization_config`. dequantized: also write the checkpoint of the weights the
    codes stand for, decoded by transformers' own MXFP4 converter (the oracle's weights)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, dst = os.fspath(src), os.fspath(dst)
    fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant, plain = {}, {}
    for name, w in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quant[name] = plain[name] = w
            continue
        rows = w.float().transpose(1, 2)                                   # [E, out, in]
        E, R, C = rows.shape
        groups = rows.reshape(E, R, C // 32, 32)
        exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
        codes = (groups / torch.exp2(exp)[..., None]).unsqueeze(-1).sub(fp4).abs().argmin(-1)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)   # [E, R, C/32, 16]
        scales = (exp + 127).to(torch.uint8)
        quant[name + "_blocks"], quant[name + "_scales"] = packed, scales
        plain[name] = convert_moe_packed_tensors(packed, scales, dtype=torch.float32).to(w.dtype).contiguous()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for out, weights in ((dst, quant), (dequantized, plain)):
        if out is None:
            continue
        out = os.fspath(out)
        os.makedirs(out, exist_ok=True)
        for fname in os.listdir(src):
            if fname not in ("model.safetensors", "config.json"):
                shutil.copy(os.path.join(src, fname), out)
        save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config)
        if out == dst:
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    return dst


def make_tiny_mtp_checkpoint(path: str | os.PathLike, seed: int = 0, num_mtp_layers: int = 1, **overrides) -> str:
    """A tiny DeepSeek-V3 checkpoint with multi-token-prediction layers in the release's layout: layers
    num_hidden_layers + i, each a decoder layer (MLA, MoE) plus `enorm`, `hnorm`, `eh_proj` `[H, 2H]`,
    `shared_head.norm`, `shared_head.head` and `embed_tokens` (copies of the target's, as the release stores them),
    and config.num_nextn_predict_layers. The decoder layers are drawn by transformers with the target's; eh_proj
    passes hnorm(h) through (plus a small random share of the embedding) and the layer's output projections are
    scaled down, so a draft is often the target's own next prediction: enough agreement that tests see drafts
    both accepted and rejected. shared_head.norm's weights are not all ones (transformers starts norms at ones),
    so a draft chained through the normed output instead of the layer's output differs."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = os.fspath(path)
    layers = tiny_config("deepseek_v3", **overrides).num_hidden_layers
    make_tiny_checkpoint("deepseek_v3", path, seed, num_hidden_layers=layers + num_mtp_layers, **overrides)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    H = tensors["model.norm.weight"].shape[0]
    for i in range(layers, layers + num_mtp_layers):
        p = f"model.layers.{i}."
        for name in list(tensors):
            if name.startswith(p) and name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = tensors[name] * 0.1
        tensors[p + "enorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        tensors[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        tensors[p + "eh_proj.weight"] = torch.cat((0.05 * torch.randn(H, H, generator=g), torch.eye(H)), dim=1)
        tensors[p + "shared_head.norm.weight"] = tensors["model.norm.weight"] * (1 + 0.2 * torch.randn(H, generator=g))
        tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=num_mtp_layers)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
