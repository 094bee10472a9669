"""ModelSpec: the architecture facts the runtime needs, read from a HF config.

One adapter per architecture maps transformers' config and weight names onto this spec.
Names: L layers, H hidden, E experts, K top-k, I expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")

# Architectures people ask for that need machinery the runtime does not have yet: model_type -> what.
UNSUPPORTED_WHY = {
    "qwen3_next": "its Gated DeltaNet linear-attention layers (a recurrent state, not a paged KV cache)",
    "deepseek_v32": "DeepSeek sparse attention (the lightning indexer that picks the top-k cached tokens)",
    "deepseek_v4": "its compressed sparse attention",
}

# transformers' rotary module of each architecture (RoPE scaling such as YaRN stays exactly theirs).
ROTARY_CLASS = {"qwen3_moe": "Qwen3MoeRotaryEmbedding", "qwen2_moe": "Qwen2MoeRotaryEmbedding",
                "mixtral": "MixtralRotaryEmbedding", "olmoe": "OlmoeRotaryEmbedding",
                "deepseek_v2": "DeepseekV2RotaryEmbedding", "deepseek_v3": "DeepseekV3RotaryEmbedding",
                "glm4_moe": "Glm4MoeRotaryEmbedding", "gpt_oss": "GptOssRotaryEmbedding"}

ROUTERS = ("softmax", "softmax_group", "sigmoid_group", "topk_softmax")
EXPERT_ACTS = ("silu", "swiglu_oai")


def unsupported_message(model_type, where: str) -> str:
    why = UNSUPPORTED_WHY.get(model_type)
    reason = f" (it needs {why})" if why else ""
    return f"model_type {model_type!r}{where} is not supported{reason}; supported: {', '.join(SUPPORTED)}"


@dataclass(slots=True, frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3). The cache holds, per token, the normalised latent
    `[kv_lora_rank]` and the shared rotary key `[qk_rope_head_dim]`; kv_b_proj expands the latent into
    per-head no-rope keys `[qk_nope_head_dim]` and values `[v_head_dim]`."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    shared_module: str = "shared_expert"  # "shared_experts" (DeepSeek, GLM: no gate)
    shared_expert_gate: bool = True       # Qwen2-MoE's sigmoid gate on the shared expert
    router: str = "softmax"               # one of ROUTERS, see attention_nodes.routing
    router_in_fp32: bool = False          # logits from fp32 activations and weights (DeepSeek, GLM)
    n_group: int = 1                      # expert groups of group-limited routing
    topk_group: int = 1                   # groups a token may pick its experts from
    routed_scaling_factor: float = 1.0
    mla: MLASpec | None = None
    rope_interleave: bool = False         # rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek)
    softmax_scale: float = 0.0            # 0 = head_dim ** -0.5
    weight_block_size: tuple[int, int] | None = None   # block-scaled FP8 checkpoint (weight_scale_inv)
    mxfp4_experts: bool = False           # GPT-OSS release: experts as MXFP4 *_blocks / *_scales
    router_module: str = "gate"           # "router" (GPT-OSS, with a bias)
    layer_windows: tuple[int | None, ...] = ()   # per layer: sliding window (GPT-OSS), None = full; () = all full
    attention_sinks: bool = False         # per-head learned sink logits (GPT-OSS self_attn.sinks)
    rope_half_tables: bool = False        # the rotary module returns cos/sin for half the dims (GPT-OSS)
    expert_act: str = "silu"              # one of EXPERT_ACTS: "swiglu_oai" is GPT-OSS's clamped SwiGLU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False             # biases on the expert projections (GPT-OSS)
    fused_experts: bool = False           # one [E, H, 2I] (gate/up interleaved) and one [E, I, H] tensor per layer
    num_skipped_layers: int = 0           # MTP layers (num_nextn_predict_layers) the checkpoint holds
    num_mtp_layers: int = 0               # of those, the ones the runtime runs (speculative method "mtp": the
                                          # first): decoder layer num_layers, the last MoE layer
    hf_config: Any = field(default=None, repr=False)

    @property
    def kv_entry(self) -> tuple[int, int, int]:
        """What the paged cache holds per token and layer: (components, heads, dim). GQA: K and V, each
        `[kv_heads, head_dim]`; MLA: one `[1, kv_lora_rank + qk_rope_head_dim]` latent entry."""
        if self.mla is not None:
            return 1, 1, self.mla.entry_dim
        return 2, self.num_kv_heads, self.head_dim

    def kv_bytes_per_token(self, dtype) -> int:
        """KV-cache bytes one token takes in one layer."""
        c, h, d = self.kv_entry
        return c * h * d * dtype.itemsize

    @property
    def attention_scale(self) -> float:
        return self.softmax_scale or self.head_dim ** -0.5

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    def with_mtp(self) -> ModelSpec:
        """This spec with the checkpoint's multi-token-prediction layers run (speculative_config method "mtp",
        attention_nodes/mtp.py): DeepSeek's release layout, decoder layers num_layers + i whose MoE FFN counts as
        MoE layer num_moe_layers + i, so its experts load and are served like any other layer's. Only the first
        MTP layer runs (DeepSeek-V3 and R1 ship one): every draft pass chains it, as vLLM does. A second layer
        would need its own cache over every position (DeepSeek's depth-2 module reads depth 1's outputs), which
        the passes do not fill."""
        if self.arch != "deepseek_v3" or not self.num_skipped_layers:
            raise ValueError(f"speculative_config method 'mtp' needs a DeepSeek-V3 checkpoint with "
                             f"multi-token-prediction layers (config.num_nextn_predict_layers >= 1); this one is "
                             f"{self.arch!r} with num_nextn_predict_layers={self.num_skipped_layers}: use method "
                             f"'ngram' or 'draft_model'")
        return replace(self, num_mtp_layers=1, moe_layers=self.moe_layers + (True,))

    def moe_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}"

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, ...]:
        """What reading one routed expert reads, as `Checkpoint.names_read` records it: its (gate, up, down)
        weights, or with fused per-layer tensors (GPT-OSS) its row `name[expert]` of each."""
        if self.fused_experts:
            return tuple(f"{n}[{expert}]" for n in self.fused_expert_names(layer).values())
        p = f"{self.moe_prefix(layer)}.experts.{expert}"
        return tuple(f"{p}.{n}.weight" for n in self.expert_names)

    def fused_expert_names(self, layer: int) -> dict[str, str]:
        """GPT-OSS: the per-layer expert tensors, by role (each indexed by expert on its first dim)."""
        p = f"{self.moe_prefix(layer)}.experts"
        if self.mxfp4_experts:
            names = {"gate_up_blocks": "gate_up_proj_blocks", "gate_up_scales": "gate_up_proj_scales",
                     "down_blocks": "down_proj_blocks", "down_scales": "down_proj_scales"}
        else:
            names = {"gate_up": "gate_up_proj", "down": "down_proj"}
        names.update(gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias")
        return {role: f"{p}.{n}" for role, n in names.items()}

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def is_expert_tensor(self, name: str) -> bool:
        return ".experts." in name and name.startswith("model.layers.")

    def rotary_embedding(self):
        """transformers' own rotary module for this architecture, so RoPE (and its scaling) is exact."""
        return getattr(_modeling(self.arch), ROTARY_CLASS[self.arch])(self.hf_config)


def _modeling(arch: str):
    import importlib
    return importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")


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
        raise ValueError(unsupported_message(arch, ""))
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    window = getattr(cfg, "sliding_window", None)
    if arch in ("qwen2_moe", "qwen3_moe") and getattr(cfg, "use_sliding_window", False) and window:
        raise ValueError(f"use_sliding_window with sliding_window={window} (Qwen's per-layer max_window_layers "
                         f"scheme) is not supported; use a checkpoint without it")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_layers = cfg.num_hidden_layers
    if arch in ("qwen3_moe", "qwen2_moe"):
        only = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        moe = tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))
    elif arch in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        moe = tuple(i >= (cfg.first_k_dense_replace or 0) for i in range(num_layers))
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
    quant = _quantization(cfg)
    if quant == "mxfp4" and arch != "gpt_oss":
        raise ValueError(f"an MXFP4 quantization_config is supported for gpt_oss only, not {arch!r}")
    common["weight_block_size"] = quant if isinstance(quant, tuple) else None
    if arch == "mixtral":
        spec = ModelSpec(**common, num_experts=cfg.num_local_experts, moe_intermediate_size=cfg.intermediate_size,
                         norm_topk_prob=True, expert_names=("w1", "w3", "w2"), moe_module="block_sparse_moe")
        if window:   # transformers' Mixtral applies its window to every layer
            spec.layer_windows = (int(window),) * num_layers
    elif arch in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        spec = _deepseek_family(cfg, common)
    elif arch == "gpt_oss":
        spec = _gpt_oss(cfg, common)
    else:
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
    if spec.router != "softmax" and (spec.num_experts % spec.n_group or not 1 <= spec.topk_group <= spec.n_group):
        raise ValueError(f"group-limited routing needs n_group dividing {spec.num_experts} experts and "
                         f"1 <= topk_group <= n_group; got n_group={spec.n_group}, topk_group={spec.topk_group}")
    return spec


def _deepseek_family(cfg, common: dict) -> ModelSpec:
    """DeepSeek-V2/V3 (MLA, shared experts, dense first layers) and GLM-4.5 (GQA with the V3 router)."""
    arch = common["arch"]
    num_experts = cfg.n_routed_experts
    n_shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
    spec = ModelSpec(**common, num_experts=num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                     norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
                     dense_intermediate_size=cfg.intermediate_size,
                     shared_expert_size=cfg.moe_intermediate_size * n_shared, shared_module="shared_experts",
                     shared_expert_gate=False, router_in_fp32=True,
                     routed_scaling_factor=float(cfg.routed_scaling_factor or 1.0),
                     num_skipped_layers=int(getattr(cfg, "num_nextn_predict_layers", 0) or 0))
    if arch == "deepseek_v2":
        method = cfg.topk_method or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported for deepseek_v2; "
                             f"use 'greedy' or 'group_limited_greedy'")
        spec.norm_topk_prob = False   # V2's router never renormalises
        if method == "group_limited_greedy":
            spec.router, spec.n_group, spec.topk_group = "softmax_group", cfg.n_group, cfg.topk_group
    else:
        spec.router, spec.n_group, spec.topk_group = "sigmoid_group", _or_one(cfg.n_group), _or_one(cfg.topk_group)
    if arch == "glm4_moe":
        if getattr(cfg, "use_qk_norm", False):
            spec.qk_norm = "per_head"
        return spec
    spec.mla = MLASpec(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                       cfg.v_head_dim)
    spec.rope_interleave = arch == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    spec.softmax_scale = _modeling(arch).yarn_apply_mscale(cfg.rope_parameters, qk_head_dim ** -0.5)
    return spec


def _or_one(value) -> int:
    """An unset (None) group count means one group; a set value is kept, so 0 is refused, not rounded up."""
    return 1 if value is None else int(value)


def _gpt_oss(cfg, common: dict) -> ModelSpec:
    """GPT-OSS: GQA with biases and sinks, alternating sliding-window and full layers, a biased router with
    softmax over the chosen logits, fused expert tensors with biases and the clamped SwiGLU."""
    windows = tuple(cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types)
    bad = [t for t in cfg.layer_types if t not in ("sliding_attention", "full_attention")]
    if bad:
        raise ValueError(f"layer_types holds {bad[0]!r}; gpt_oss layers are 'sliding_attention' or 'full_attention'")
    return ModelSpec(**common, num_experts=cfg.num_local_experts, moe_intermediate_size=cfg.intermediate_size,
                     norm_topk_prob=False, router="topk_softmax", router_module="router", layer_windows=windows,
                     attention_sinks=True, rope_half_tables=True, expert_act="swiglu_oai",
                     swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
                     swiglu_limit=float(cfg.swiglu_limit), expert_bias=True, fused_experts=True,
                     mxfp4_experts=_quantization(cfg) == "mxfp4")


def _quantization(cfg) -> tuple[int, int] | str | None:
    """None (unquantized), the block size of a block-scaled FP8 checkpoint (DeepSeek-V3's release format) or
    "mxfp4" (GPT-OSS's release format). Any other quantization is refused by name."""
    q = getattr(cfg, "quantization_config", None)
    if not q:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method == "fp8" and q.get("weight_block_size"):
        rows, cols = q["weight_block_size"]
        return int(rows), int(cols)
    if method == "mxfp4":
        return "mxfp4"
    raise ValueError(f"quantization_config quant_method={method!r} ({q}) is not supported; the runtime reads "
                     f"unquantized checkpoints, block-scaled FP8 (quant_method 'fp8' with weight_block_size) "
                     f"and GPT-OSS's MXFP4 experts")
