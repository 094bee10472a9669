"""Tiny random checkpoints for tests, the demo and benchmarks, made locally with transformers
(config -> save_pretrained), no network."""
from __future__ import annotations

import os

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
TINY_VOCAB = 320  # >= 256 byte-level symbols + 3 specials of the tiny tokenizer


def tiny_config(arch: str, **overrides):
    """A small config of the given architecture. initializer_range is large so random logits are well
    separated and greedy decoding is not decided by rounding."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

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
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def make_tiny_checkpoint(arch: str, path: str | os.PathLike, seed: int = 0, max_shard_size: str | None = None,
                         with_tokenizer: bool = True, **overrides) -> str:
    """Write a random checkpoint of `arch` (and a tiny tokenizer) to path and return path."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(os.fspath(path), **kwargs)
    if with_tokenizer:
        save_tiny_tokenizer(path, model.config.vocab_size)
    return os.fspath(path)


# A minimal chat format of our own: each message as "<s>role\ncontent</s>\n", then "<s>assistant\n" to answer.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


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
