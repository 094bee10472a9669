"""The non-expert half of the model, run on attention ranks.

Embeddings, attention over the paged KV, norms, router, shared expert, dense FFN layers and the
LM head. Routed experts are reached through `MoEContext.start(...)` / `finish(...)`, which dispatch to
the expert ranks and combine their results: the only collectives in the forward.
Names: T tokens, H hidden, h/kvh heads, d head dim, K top-k, E experts, V vocab.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from balancer.policy import ReplicaPolicy
from comm.dispatcher import Dispatcher, PendingDispatch
from kernels import ops
from models.spec import ModelSpec

from .batch import ForwardBatch
from .kv_cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same arithmetic as transformers' RMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k router (Qwen2/3-MoE, Mixtral, OLMoE). logits `[T, E]` ->
    (weights `[T, K]` fp32, ids `[T, K]` int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(slots=True)
class MoEContext:
    """How a MoE layer reaches its experts: the balancer's replica choice and the dispatcher.
    phy ids from the policy map to (world rank, slot) via num_attention_ranks and num_slots.
    Policies that need every attention rank's per-expert counts get them by one all_gather of `[E]`
    int64 over the attention group per layer and micro-batch (every attention rank joins, in the same
    order as its dispatches)."""

    dispatcher: Dispatcher
    policy: ReplicaPolicy
    num_attention_ranks: int
    num_slots: int
    num_experts: int
    attention_group: object
    source: int         # this rank's index among the attention ranks

    def start(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> PendingDispatch:
        """Send x `[T, H]` to the replicas of its experts ids `[T, K]` (router weights `[T, K]`), not waiting."""
        counts = None
        if self.policy.needs_counts:
            mine = torch.bincount(ids.reshape(-1), minlength=self.num_experts).cpu()
            if self.num_attention_ranks > 1:
                every = [torch.empty_like(mine) for _ in range(self.num_attention_ranks)]
                dist.all_gather(every, mine, group=self.attention_group)
                counts = torch.stack(every)
            else:
                counts = mine[None]
        phy = self.policy.choose(moe_layer, ids, counts, self.source)
        dst = self.num_attention_ranks + phy // self.num_slots
        return self.dispatcher.start_dispatch(moe_layer, x, dst, phy % self.num_slots, weights)

    def finish(self, pending: PendingDispatch) -> torch.Tensor:
        """Wait for the experts -> routed-expert output `[T, H]`."""
        rows, handle = self.dispatcher.finish_dispatch(pending)
        assert rows.hidden.shape[0] == 0, "attention ranks hold no experts"
        return self.dispatcher.combine(rows.hidden, handle)


class AttentionModel:
    """Holds the non-expert weights (named as in the HF checkpoint) and runs the forward. kernel_backend: the
    resolved `kernels.ops` backend ("triton" or "torch") of its attention calls."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device,
                 kernel_backend: str = "torch"):
        self.spec = spec
        self.kernel_backend = kernel_backend
        self.w = weights
        self.device = device
        self.rotary = spec.rotary_embedding().to(device)
        self.scale = spec.head_dim ** -0.5
        lm = "model.embed_tokens.weight" if spec.tie_word_embeddings and "lm_head.weight" not in weights \
            else "lm_head.weight"
        self.lm_head = weights[lm]

    def _get(self, name: str) -> torch.Tensor | None:
        return self.w.get(name)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self._get(prefix + ".bias"))

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        g = self._linear(x, prefix + ".gate_proj")
        return self._linear(F.silu(g) * self._linear(x, prefix + ".up_proj"), prefix + ".down_proj")

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        s, p = self.spec, f"model.layers.{i}.self_attn"
        T = x.shape[0]
        q, k, v = (self._linear(x, f"{p}.{n}_proj") for n in "qkv")
        if s.qk_norm == "full":
            q = rms_norm(q, self.w[f"{p}.q_norm.weight"], s.rms_norm_eps)
            k = rms_norm(k, self.w[f"{p}.k_norm.weight"], s.rms_norm_eps)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        q = q.view(T, s.num_heads, s.head_dim)
        k = k.view(T, s.num_kv_heads, s.head_dim)
        v = v.view(T, s.num_kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            q = rms_norm(q, self.w[f"{p}.q_norm.weight"], s.rms_norm_eps)
            k = rms_norm(k, self.w[f"{p}.k_norm.weight"], s.rms_norm_eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache, v_cache = kv.layer(i)
        ops.write_kv(k_cache, v_cache, k, v, batch.slot_mapping, self.kernel_backend)
        out = torch.empty_like(q)
        nd, dec, pre = batch.num_decodes, batch.decode, batch.prefill
        if dec is not None:
            out[:nd] = ops.paged_decode_attention(q[:nd], k_cache, v_cache, dec.block_tables, dec.context_lens,
                                                  self.scale, self.kernel_backend,
                                                  max_context_len=dec.max_context_len, plan=dec.plan)
        if pre is not None:
            out[nd:] = ops.paged_prefill_attention(q[nd:], k_cache, v_cache, pre.block_tables, pre.cu_seqlens_q,
                                                   pre.context_lens, self.scale, self.kernel_backend)
        return self._linear(out.reshape(T, s.num_heads * s.head_dim), f"{p}.o_proj")

    def _layers(self, batch: ForwardBatch, kv: KVCache):
        """The forward of one micro-batch as a generator: at each MoE layer it yields (moe_layer, x `[T, H]`,
        ids `[T, K]`, weights `[T, K]`) and is sent back the routed-expert output `[T, H]`; it returns the
        logits `[len(batch.logit_rows), V]` fp32."""
        s = self.spec
        h = F.embedding(batch.input_ids, self.w["model.embed_tokens.weight"])
        cos, sin = self.rotary(h[None], batch.positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        moe_layer = 0
        for i in range(s.num_layers):
            p = f"model.layers.{i}"
            h = h + self._attention(i, rms_norm(h, self.w[f"{p}.input_layernorm.weight"], s.rms_norm_eps),
                                    cos, sin, batch, kv)
            x = rms_norm(h, self.w[f"{p}.post_attention_layernorm.weight"], s.rms_norm_eps)
            if not s.moe_layers[i]:
                h = h + self._mlp(x, f"{p}.mlp")
                continue
            m = s.moe_prefix(i)
            weights, ids = route(F.linear(x, self.w[f"{m}.gate.weight"]), s.top_k, s.norm_topk_prob)
            out = yield moe_layer, x, ids, weights
            if s.shared_expert_size:
                shared = self._mlp(x, f"{m}.shared_expert")
                out = out + torch.sigmoid(F.linear(x, self.w[f"{m}.shared_expert_gate.weight"])) * shared
            h = h + out
            moe_layer += 1
        h = rms_norm(h[batch.logit_rows], self.w["model.norm.weight"], s.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    @torch.inference_mode()
    def forward(self, batches: list[ForwardBatch], kv: KVCache, moe: MoEContext) -> torch.Tensor:
        """Run micro-batches as a ping-pong pipeline: while the experts serve one micro-batch's layer, this
        rank computes another's attention. Every micro-batch joins every MoE layer's dispatch and combine,
        even with no tokens. Per layer the collectives go out as: dispatch mb 0..M-1, then combine
        mb 0..M-1 (expert ranks follow the same order). Returns the logits of all micro-batches, in order."""
        M = len(batches)
        gens = [self._layers(b, kv) for b in batches]
        logits: list[torch.Tensor | None] = [None] * M
        # Step 1: each micro-batch runs to its first MoE layer; its dispatch starts at once.
        pending = [self._advance(gens[j], None, moe, logits, j) for j in range(M)]
        # Step 2: per layer, combine each micro-batch and compute its next attention while the experts
        # work on the following micro-batches; the next layer's dispatches start after every combine.
        while pending[0] is not None:
            ready = []
            for j in range(M):
                out = moe.finish(pending[j])
                ready.append(self._next(gens[j], out, logits, j, moe) if j < M - 1 else out)
            pending = [None if r is None else moe.start(*r) for r in ready[:-1]]
            pending.append(self._advance(gens[-1], ready[-1], moe, logits, M - 1))
        return torch.cat(logits)

    @staticmethod
    def _next(gen, value, logits: list, j: int, moe: MoEContext):
        """Resume a micro-batch up to its next MoE layer -> its request, or None once it has its logits. The
        time it computes goes to the comm stats, under that MoE layer (-1: the tail up to the logits)."""
        t0 = time.perf_counter()
        try:
            request = gen.send(value)
        except StopIteration as stop:
            logits[j] = stop.value
            moe.dispatcher.stats.add_compute(-1, t0, time.perf_counter())
            return None
        moe.dispatcher.stats.add_compute(request[0], t0, time.perf_counter())
        return request

    def _advance(self, gen, value, moe: MoEContext, logits: list, j: int) -> PendingDispatch | None:
        request = self._next(gen, value, logits, j, moe)
        return None if request is None else moe.start(*request)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, d]`, cos/sin `[T, 1, d]`: transformers' rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
