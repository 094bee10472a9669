"""Tiny random checkpoints for tests, the demo and benchmarks, made locally with transformers
(config -> save_pretrained), no network."""
from __future__ import annotations

import os

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def tiny_config(arch: str, **overrides):
    """A small config of the given architecture. initializer_range is large so random logits are well
    separated and greedy decoding is not decided by rounding."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
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
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def make_tiny_checkpoint(arch: str, path: str | os.PathLike, seed: int = 0, max_shard_size: str | None = None,
                         **overrides) -> str:
    """Write a random checkpoint of `arch` to path and return path."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(os.fspath(path), **kwargs)
    return os.fspath(path)
