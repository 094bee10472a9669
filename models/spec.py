"""ModelSpec: the architecture facts the runtime needs, read from a HF config.

One adapter per architecture maps transformers' config and weight names onto this spec.
Names: L layers, H hidden, E experts, K top-k, I expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@dataclass(slots=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]          # [L] True where the FFN is the routed MoE
    dense_intermediate_size: int = 0      # FFN width of non-MoE layers
    shared_expert_size: int = 0           # 0 = no shared expert (Qwen2-MoE has one, sigmoid-gated)
    qk_norm: str = "none"                 # "none" | "per_head" (Qwen3) | "full" (OLMoE)
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    moe_module: str = "mlp"               # "block_sparse_moe" for Mixtral
    hf_config: Any = field(default=None, repr=False)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    def moe_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}"

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """(gate, up, down) weight names of one routed expert."""
        p = f"{self.moe_prefix(layer)}.experts.{expert}"
        return tuple(f"{p}.{n}.weight" for n in self.expert_names)  # type: ignore[return-value]

    def is_expert_tensor(self, name: str) -> bool:
        return ".experts." in name and name.startswith("model.layers.")

    def rotary_embedding(self):
        """transformers' own rotary module for this architecture, so RoPE (and its scaling) is exact."""
        import importlib
        mod = importlib.import_module(f"transformers.models.{self.arch}.modeling_{self.arch}")
        cls_name = {"qwen3_moe": "Qwen3MoeRotaryEmbedding", "qwen2_moe": "Qwen2MoeRotaryEmbedding",
                    "mixtral": "MixtralRotaryEmbedding", "olmoe": "OlmoeRotaryEmbedding"}[self.arch]
        return getattr(mod, cls_name)(self.hf_config)


def _eos_ids(cfg, gen_cfg) -> tuple[int, ...]:
    for src in (gen_cfg, cfg):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids = [eos] if isinstance(eos, int) else list(eos)
            return tuple(int(i) for i in ids if 0 <= int(i) < cfg.vocab_size)
    return ()


def spec_from_hf_config(cfg, gen_cfg=None) -> ModelSpec:
    """Build a ModelSpec from a transformers PretrainedConfig. Raises ValueError on anything unsupported."""
    arch = cfg.model_type
    if arch not in SUPPORTED:
        raise ValueError(f"model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED)}")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", arch == "mixtral") and window and window < cfg.max_position_embeddings:
        raise ValueError(f"sliding_window={window} is not supported yet; use a checkpoint without it")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_layers = cfg.num_hidden_layers
    if arch in ("qwen3_moe", "qwen2_moe"):
        only = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        moe = tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))
    else:
        moe = (True,) * num_layers
    common = dict(
        arch=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=num_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        top_k=cfg.num_experts_per_tok, moe_layers=moe,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(cfg, gen_cfg), hf_config=cfg,
    )
    if arch == "mixtral":
        return ModelSpec(**common, num_experts=cfg.num_local_experts, moe_intermediate_size=cfg.intermediate_size,
                         norm_topk_prob=True, expert_names=("w1", "w3", "w2"), moe_module="block_sparse_moe")
    spec = ModelSpec(**common, num_experts=cfg.num_experts, moe_intermediate_size=(
        cfg.intermediate_size if arch == "olmoe" else cfg.moe_intermediate_size),
        norm_topk_prob=bool(cfg.norm_topk_prob), dense_intermediate_size=cfg.intermediate_size)
    if arch == "qwen3_moe":
        spec.qk_norm = "per_head"
    elif arch == "qwen2_moe":
        spec.shared_expert_size = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    elif arch == "olmoe":
        spec.qk_norm = "full"
        spec.clip_qkv = getattr(cfg, "clip_qkv", None)
    if spec.top_k > spec.num_experts:
        raise ValueError(f"num_experts_per_tok={spec.top_k} exceeds num_experts={spec.num_experts}")
    return spec
