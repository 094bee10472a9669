"""Per-architecture sizing at real scale, from transformers' default configs (each default is a released
model, named in the table): KV-cache bytes per token, and what an attention rank holds (every non-expert
weight: attention, norms, router, shared experts, dense first layers, embeddings) against the routed experts.
Models are built on the meta device, so nothing is allocated.

    python scripts/model_sizes.py          # prints the table in docs/models.md
"""
from __future__ import annotations

import torch

from models.spec import spec_from_hf_config

# transformers config class -> the released model its defaults describe (with OVERRIDES where they do not)
MODELS = {
    "DeepseekV3Config": "DeepSeek-V3 (671B)",
    "DeepseekV2Config": "DeepSeek-V2-Lite (16B)",
    "Glm4MoeConfig": "GLM-4.5-Air (106B)",
    "GptOssConfig": "gpt-oss-120b",
    "Qwen3MoeConfig": "Qwen3-30B-A3B",
    "Qwen2MoeConfig": "Qwen1.5-MoE-A2.7B",
    "MixtralConfig": "Mixtral-8x7B",
    "OlmoeConfig": "OLMoE-1B-7B",
}
# Published config.json values where transformers' defaults differ from the release or leave fields unset.
OVERRIDES = {
    "Glm4MoeConfig": dict(head_dim=128),
    "Qwen3MoeConfig": dict(num_hidden_layers=48, head_dim=128),
    "DeepseekV2Config": dict(vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                             num_experts_per_tok=6, moe_intermediate_size=1408, intermediate_size=10944,
                             first_k_dense_replace=1),
}
GIB = 2 ** 30


def sizes(cls_name: str, dtype=torch.bfloat16) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, cls_name)(**OVERRIDES.get(cls_name, {}))
    spec = spec_from_hf_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expert = dense = other = 0
    for name, p in model.named_parameters():
        n = p.numel() * dtype.itemsize
        if ".experts." in name:
            expert += n
        elif ".mlp." in name and not spec.moe_layers[int(name.split(".")[2])]:
            dense += n
        else:
            other += n
    per_layer = spec.kv_bytes_per_token(dtype)
    return {"model": MODELS[cls_name], "arch": spec.arch, "attention": "MLA" if spec.mla else "GQA",
            "kv_layer": per_layer, "kv_token": per_layer * spec.num_layers, "layers": spec.num_layers,
            "attention_rank_gib": (other + dense) / GIB, "dense_gib": dense / GIB, "experts_gib": expert / GIB}


def main() -> None:
    print("| model (transformers config) | arch | attention | KV bytes/token/layer (bf16) | "
          "KV per token, all layers | attention-rank weights | of which dense first layers | routed experts |")
    print("|---|---|---|---|---|---|---|---|")
    for cls_name in MODELS:
        r = sizes(cls_name)
        print(f"| {r['model']} | `{r['arch']}` | {r['attention']} | {r['kv_layer']:,} | "
              f"{r['kv_token'] / 1024:.1f} KiB ({r['layers']} layers) | {r['attention_rank_gib']:.1f} GiB | "
              f"{r['dense_gib']:.2f} GiB | {r['experts_gib']:.1f} GiB |")


if __name__ == "__main__":
    main()
