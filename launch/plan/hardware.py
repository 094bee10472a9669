"""Step costs at cluster scale, derived from a model's shape and a GPU's and a network's published figures
(`python -m launch.plan --hardware NAME`): predictions, not measurements.

The model's parameters are counted on the meta device from its transformers config (no weights are read):
routed-expert tensors (`.experts.` in the name) go to the expert pool, everything else of the decoder layers
(attention, norms, router, shared experts, dense FFN layers) to the attention pool, the LM head to the tail (the
embedding only takes memory: a step reads one row per token). Per call, a step costs what a roofline gives at
the efficiencies below:
- a0: reading one MoE layer's share of the attention-side weights; a_tok: their FLOPs per token; a_ctx: reading
  one token's KV entry in one MoE layer's share of the layers (decode reads the whole context), plus the
  attention's own FLOPs per (query, key) pair there in BF16 (scores and values over every query head; MLA with
  the projections absorbed, as FlashMLA runs it: the latent and rotary key, then the latent value);
- e_all: reading every routed expert of a layer, shared by the expert ranks; e_pair: one (token, expert) pair's
  FLOPs; e0: one kernel launch;
- c0: the link's latency per exchange; c_tok: a token's dispatch (weight dtype) and combine (bf16) bytes to its
  top-k experts over the link (NVLink within a node; the NIC between nodes, once per node at most topk_group
  nodes where routing is group-limited). Only the attention rank's side of the link is counted;
- l0 / l_row: the LM head's weights read / FLOPs per logit row;
- h0 / h_seq: the engine's host work per step (--host-ms; 0: a CUDA-graph engine that hides it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import StepCosts

MEMORY_EFFICIENCY = 0.8     # of the datasheet HBM bandwidth a decode kernel reaches (H100: 0.73 measured, below)
COMPUTE_EFFICIENCY = 0.6    # of the datasheet dense FLOP/s a grouped GEMM reaches (H100: 0.41 measured at 8192 rows)
LAUNCH_S = 5e-6             # one kernel launch


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    hbm_bytes_s: float          # datasheet HBM bandwidth
    flops_bf16: float           # dense, no sparsity
    flops_fp8: float
    memory_bytes: float
    link_bytes_s: float         # per GPU per direction, within a node (NVLink)
    nic_bytes_s: float          # per GPU per direction, between nodes
    link_latency_s: float
    nic_latency_s: float
    source: str


# Datasheet figures: NVIDIA H100 Tensor Core GPU datasheet (SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16, 1979
# dense FP8, 80 GB, NVLink 900 GB/s both directions); NVIDIA H200 datasheet (4.8 TB/s HBM3e, 141 GB, the H100's
# compute); the H800 is the H100 SXM with NVLink at 400 GB/s both directions (NVIDIA's China-market part, as
# DeepSeek-V3's report describes its cluster); 400 Gb/s InfiniBand NDR per GPU (ConnectX-7): 50 GB/s each way.
# Latencies are typical one-way figures for NVLink (~2 us) and RDMA over NDR (~5 us) plus a kernel's launch.
HARDWARE = {
    "h100": Hardware("h100", 3.35e12, 989e12, 1979e12, 80e9, 450e9, 50e9, 2e-6, 5e-6,
                     "NVIDIA H100 SXM datasheet; NVLink 4 (900 GB/s), 400G NDR InfiniBand per GPU"),
    "h200": Hardware("h200", 4.8e12, 989e12, 1979e12, 141e9, 450e9, 50e9, 2e-6, 5e-6,
                     "NVIDIA H200 SXM datasheet; NVLink 4 (900 GB/s), 400G NDR InfiniBand per GPU"),
    "h800": Hardware("h800", 3.35e12, 989e12, 1979e12, 80e9, 200e9, 50e9, 2e-6, 5e-6,
                     "H100 SXM figures with NVLink at 400 GB/s (H800); 400G NDR InfiniBand per GPU"),
}


@dataclass(frozen=True, slots=True)
class ParamCounts:
    attention_per_moe_layer: int    # attention-side decoder parameters over the MoE layers
    experts_per_moe_layer: int      # routed-expert parameters of one MoE layer (all its experts)
    expert_params: int              # one routed expert
    tail: int                       # LM head
    kv_entry_elems: int             # per token and layer
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    embed: int = 0                  # the input embedding (memory only)
    node_limit: int = 0             # group-limited routing: the most groups (nodes) a token's experts span
    num_layers: int = 0
    pair_flops: int = 0             # attention FLOPs per (query, key) pair and layer


def count_params(config) -> ParamCounts:
    """Parameter counts of a transformers config's model, built on the meta device."""
    from transformers import AutoModelForCausalLM

    from models.spec import spec_from_hf_config

    spec = spec_from_hf_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = attention = 0
    for name, p in model.named_parameters():
        if ".layers." not in name:
            continue
        if ".experts." in name or name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            experts += p.numel()
        else:
            attention += p.numel()
    L = spec.num_moe_layers
    c, h, d = spec.kv_entry
    tail = model.get_output_embeddings().weight.numel()     # tied or not, the head is read once per row
    embed = model.get_input_embeddings().weight.numel()
    if spec.mla is not None:    # absorbed: q . [latent, rope key], then p . latent value, per query head
        pair = 2 * spec.num_heads * (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim + spec.mla.kv_lora_rank)
    else:
        pair = 2 * spec.num_heads * spec.head_dim * 2
    return ParamCounts(attention // L, experts // L, experts // L // spec.num_experts, tail, c * h * d, L,
                       spec.num_experts, spec.top_k, spec.hidden_size, embed=embed,
                       node_limit=spec.topk_group if spec.n_group > 1 else 0, num_layers=spec.num_layers,
                       pair_flops=pair)


def derive_costs(counts: ParamCounts, hw: Hardware, weight_bytes: float = 1.0, kv_bytes: float = 1.0,
                 inter_node: bool = True, host_s: float = 0.0, host_seq_s: float = 0.0) -> StepCosts:
    """The step costs of the model on this hardware (weight_bytes / kv_bytes: bytes per weight / KV element, 1
    for FP8), with dispatch over the NIC (inter_node) or NVLink."""
    bw = hw.hbm_bytes_s * MEMORY_EFFICIENCY
    flops = (hw.flops_fp8 if weight_bytes <= 1 else hw.flops_bf16) * COMPUTE_EFFICIENCY
    link = hw.nic_bytes_s if inter_node else hw.link_bytes_s
    latency = hw.nic_latency_s if inter_node else hw.link_latency_s
    if not (weight_bytes > 0 and kv_bytes > 0):
        raise ValueError(f"weight_bytes={weight_bytes}, kv_bytes={kv_bytes}: bytes per element must be > 0")
    # dispatch + combine bytes of a token: within a node one copy per expert; between nodes one per node its
    # experts sit on, at most topk_group nodes where routing is group-limited (DeepSeek-V3: 4 of 8 groups),
    # forwarded within the node over NVLink (two_phase)
    copies = min(counts.top_k, counts.node_limit or counts.top_k) if inter_node else counts.top_k
    per_token = copies * counts.hidden * (weight_bytes + 2)
    layers_per_moe = (counts.num_layers or counts.moe_layers) / counts.moe_layers
    return StepCosts(
        a0=counts.attention_per_moe_layer * weight_bytes / bw + LAUNCH_S,
        a_tok=2 * counts.attention_per_moe_layer / flops,
        a_ctx=layers_per_moe * (counts.kv_entry_elems * kv_bytes / bw
                                + counts.pair_flops / (hw.flops_bf16 * COMPUTE_EFFICIENCY)),
        e0=LAUNCH_S, e_all=counts.experts_per_moe_layer * weight_bytes / bw,
        e_pair=2 * counts.expert_params / flops,
        c0=2 * latency + 2 * LAUNCH_S, c_tok=per_token / link,
        l0=counts.tail * weight_bytes / bw, l_row=2 * counts.tail / flops,
        h0=host_s, h_seq=host_seq_s, moe_layers=counts.moe_layers, top_k=counts.top_k,
        num_experts=counts.num_experts, hidden=counts.hidden, dtype_bytes=2,     # tokens dispatched in BF16
        source=f"derived from {hw.name} ({hw.source}) at {MEMORY_EFFICIENCY:.0%} of its bandwidth and "
               f"{COMPUTE_EFFICIENCY:.0%} of its FLOP/s: a prediction")


PRESETS = ("deepseek-v3", "qwen3-235b-a22b")


def model_config(name: str):
    """A transformers config: a preset's published shape (no weights anywhere), or a checkpoint directory's."""
    from transformers import AutoConfig, DeepseekV3Config, Qwen3MoeConfig

    if name == "deepseek-v3":       # transformers' defaults are DeepSeek-V3's published config
        return DeepseekV3Config()
    if name == "qwen3-235b-a22b":   # Qwen3-235B-A22B's config.json
        return Qwen3MoeConfig(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                              head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                              intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ValueError(f"model {name!r}: not a preset ({', '.join(PRESETS)}) nor a checkpoint directory with a "
                         f"config.json ({e})") from e


def memory_limits(counts: ParamCounts, hw: Hardware, weight_bytes: float, kv_bytes: float, context: int,
                  utilization: float = 0.9, redundant_experts: int = 0) -> tuple[int, int]:
    """What the GPUs' memory allows -> (the fewest expert ranks that hold the routed experts and the redundant
    slots, the most sequences of `context` tokens an attention rank holds beside its weights)."""
    room = hw.memory_bytes * utilization
    experts = (counts.experts_per_moe_layer + redundant_experts * counts.expert_params) * counts.moe_layers \
        * weight_bytes
    return -(-int(experts) // int(room)), max(0, _seqs_beside(counts, hw, 0, weight_bytes, kv_bytes, context,
                                                             utilization))


def _seqs_beside(counts: ParamCounts, hw: Hardware, expert_params: int, weight_bytes: float, kv_bytes: float,
                 context: int, utilization: float) -> int:
    """Sequences of `context` tokens whose KV fits a GPU beside the attention side's weights (attention, norms,
    shared experts, embedding, head) and expert_params more; negative when the weights alone do not fit."""
    weights = (counts.attention_per_moe_layer * counts.moe_layers + counts.tail + counts.embed
               + expert_params) * weight_bytes
    per_seq = context * counts.kv_entry_elems * kv_bytes * counts.num_layers
    return int((hw.memory_bytes * utilization - weights) // per_seq)


def colocated_decode(counts: ParamCounts, hw: Hardware, ranks: int, context: int, tpot_s: float,
                     micro_batches: int = 2, redundant_experts: int = 0, weight_bytes: float = 1.0,
                     kv_bytes: float = 1.0, host_s: float = 0.0, utilization: float = 0.9) -> dict:
    """The colocated expert-parallel decode that DeepSeek's inference overview describes, on the same roofline
    costs as the AF plans (derive_costs, dispatch over the NIC): every GPU runs the attention side of its own
    B sequences (data parallel) and (num_experts + redundant_experts) / ranks expert slots of each MoE layer,
    with the batch in micro_batches whose dispatch and combine overlap the other's compute (dual-batch
    overlap). Per MoE layer and micro-batch of b = B / micro_batches sequences at `context` tokens:
    compute = a0 + (a_tok + a_ctx * context) * b + slots * (one expert's weights read) + e_pair * top_k * b + e0
    (expert load balanced), comm = c0 + c_tok * b; a layer takes M * max(compute, comm) (compute + comm with one
    micro-batch), a step every MoE layer, one fill of min(compute, comm) (the overlap runs across layers, as the
    AF plans' ping-pong), the LM head and host_s. Returns the largest B within tpot_s and the GPU's memory
    (utilization of it for weights and KV) with its step time and output tok/s per GPU."""
    costs = derive_costs(counts, hw, weight_bytes, kv_bytes, True, host_s)
    slots = -(-(counts.num_experts + redundant_experts) // ranks)
    slot_s = slots * counts.expert_params * weight_bytes / (hw.hbm_bytes_s * MEMORY_EFFICIENCY)
    M = micro_batches

    def step_s(B: int) -> float:
        b = B / M
        compute = costs.a0 + (costs.a_tok + costs.a_ctx * context) * b + slot_s + costs.e_pair * counts.top_k * b \
            + costs.e0
        comm = costs.c0 + costs.c_tok * b
        layers = costs.moe_layers * (compute + comm) if M == 1 else \
            costs.moe_layers * M * max(compute, comm) + min(compute, comm)
        return layers + M * costs.l0 + costs.l_row * B + host_s

    most = _seqs_beside(counts, hw, slots * counts.expert_params * counts.moe_layers, weight_bytes, kv_bytes,
                        context, utilization)
    if most < M or step_s(M) > tpot_s:
        raise ValueError(f"no batch fits: {most} sequences of {context} tokens fit a GPU's memory, and "
                         f"{M} sequences take {step_s(M) * 1e3:.1f} ms a step against a TPOT of {tpot_s * 1e3:.0f} ms")
    lo, hi = M, most                  # step_s grows with B: the largest B within tpot_s
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_s(mid) <= tpot_s else (lo, mid - 1)
    return {"seqs_per_gpu": lo, "memory_seqs": most, "slots_per_gpu": slots, "step_ms": step_s(lo) * 1e3,
            "tok_s_per_gpu": lo / step_s(lo), "bound": "memory" if lo == most else "tpot"}
