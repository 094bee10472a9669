"""The non-expert half of the model, run on attention ranks.

Embeddings, attention over the paged KV, norms, router, shared expert, dense FFN layers and the
LM head. Routed experts are reached through `MoEContext.start(...)` / `finish(...)`, which dispatch to
the expert ranks and combine their results: the only collectives in the forward.
Names: T tokens, H hidden, h/kvh heads, d head dim, K top-k, E experts, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from balancer.policy import ReplicaPolicy
from comm.dispatcher import Dispatcher, PendingDispatch
from kernels import cpu_ops, ops
from models.spec import ModelSpec

from .batch import ForwardBatch
from .graphs import DecodeGraphs, capture_failed
from .kv_cache import KVCache
from .routing import route

# DeepSeek's q_a/kv_a norms are built without the config's eps: transformers' RMSNorm default.
MLA_NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same arithmetic as transformers' RMSNorm: normalise in fp32, cast back, then scale. In fp32 the casts
    are no-ops and torch's one fused op gives the same bits (tests/attention_nodes/test_rms_norm.py) for a
    sixth of the ops; other dtypes keep transformers' two roundings."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(slots=True)
class MoEContext:
    """How a MoE layer reaches its experts: the balancer's replica choice and the dispatcher.
    phy ids from the policy map to (world rank, slot) via num_attention_ranks and num_slots.
    Policies that need every attention rank's per-expert counts get them per layer and micro-batch from the
    dispatcher's `gather_counts` (every attention rank joins, in the same order as its dispatches), on the ids'
    device into a persistent `[A * E]` buffer: through the same-host inboxes where the data plane has them, else
    one all_gather over attention_group, on the data plane's backend (ProcessGroups.attention_data)."""

    dispatcher: Dispatcher
    policy: ReplicaPolicy
    num_attention_ranks: int
    num_slots: int
    num_experts: int
    attention_group: object
    source: int         # this rank's index among the attention ranks
    counts: torch.Tensor | None = None      # `[A * E]` int64 every attention rank's counts, made on first use
    waited_s: float = 0.0                   # seconds this rank's forwards have waited for the experts, so far

    def start(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> PendingDispatch:
        """Send x `[T, H]` to the replicas of its experts ids `[T, K]` (router weights `[T, K]`), not waiting."""
        counts = None
        if self.policy.needs_counts:
            # scatter_add, not bincount: bincount on CUDA reads the largest id on the host to size its output
            flat = ids.reshape(-1)
            mine = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
                0, flat, torch.ones_like(flat))
            if self.num_attention_ranks > 1:
                if self.counts is None:
                    self.counts = mine.new_empty(self.num_attention_ranks * self.num_experts)
                self.dispatcher.gather_counts(self.counts, mine, self.attention_group)
                counts = self.counts.view(self.num_attention_ranks, self.num_experts)
            else:
                counts = mine[None]
        phy = self.policy.choose(moe_layer, ids, counts, self.source)
        dst = self.num_attention_ranks + phy // self.num_slots
        return self.dispatcher.start_dispatch(moe_layer, x, dst, phy % self.num_slots, weights)

    def finish(self, pending: PendingDispatch, timed: bool = True) -> torch.Tensor:
        """Wait for the experts -> routed-expert output `[T, H]`. timed: count the wait in waited_s (not for the
        empty rounds a helper thread joins beside the forward, attention_nodes/passes.py)."""
        t0 = self.dispatcher.stats.now() if timed else 0.0
        rows, handle = self.dispatcher.finish_dispatch(pending)
        assert rows.hidden.shape[0] == 0, "attention ranks hold no experts"
        out = self.dispatcher.combine(rows.hidden, handle)
        if timed:
            self.waited_s += self.dispatcher.stats.now() - t0
        return out


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
        self.scale = spec.attention_scale
        self.absorbed = [self._absorb(i) for i in range(spec.num_layers + spec.num_mtp_layers)] if spec.mla else []
        lm = "model.embed_tokens.weight" if spec.tie_word_embeddings and "lm_head.weight" not in weights \
            else "lm_head.weight"
        self.lm_head = weights[lm]
        self.fused = _fuse_projections(weights)
        self.keep_hidden = False    # forward keeps every row's final-normed hidden state in self.hidden (MTP)
        self.hidden: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None    # decode graphs (attention_nodes/graphs.py), when on
        # kernel backend "cpu" on fp32: the residual adds, norms, q/k norms, rotary embedding and KV writes go to
        # the fused C ops (kernels/cpu_ops.py) instead of a dozen small torch ops per layer.
        self.c_norms = (kernel_backend == "cpu" and torch.device(device).type == "cpu"
                        and self.lm_head.dtype == torch.float32 and cpu_ops.available())
        self.c_qkv = self.c_norms and not spec.mla and spec.qk_norm in ("none", "per_head") \
            and spec.clip_qkv is None and spec.head_dim % 2 == 0

    def _absorb(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA layer i's kv_b_proj split for the weight-absorbed form: (W_UK `[h, nope, c]`, which folds into
        the query, and W_UV^T `[h, c, v]`, which maps the attended latent to each head's value)."""
        m, h = self.spec.mla, self.spec.num_heads
        w = self.w[f"model.layers.{i}.self_attn.kv_b_proj.weight"].view(h, m.qk_nope_head_dim + m.v_head_dim,
                                                                         m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim].contiguous(), w[:, m.qk_nope_head_dim:].transpose(1, 2).contiguous()

    def _get(self, name: str) -> torch.Tensor | None:
        return self.w.get(name)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self._get(prefix + ".bias"))

    def _fused(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
        """One GEMM for projections fused at load time (`_fuse_projections`), split back into its parts."""
        weight, bias, sizes = self.fused[name]
        return F.linear(x, weight, bias).split(sizes, dim=-1)

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        g, u = self._fused(x, prefix + ".gate_up_proj")
        return self._linear(F.silu(g) * u, prefix + ".down_proj")

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        s, p = self.spec, f"model.layers.{i}.self_attn"
        T = x.shape[0]
        k_cache, v_cache = kv.layer(i)
        if self.c_qkv and cpu_ops.supports_cache(k_cache, v_cache, s.head_dim):
            weight, bias, _ = self.fused[f"{p}.qkv_proj"]
            norms = [self._get(f"{p}.{n}_norm.weight") if s.qk_norm == "per_head" else None for n in "qk"]
            q = cpu_ops.qkv_rope_write(F.linear(x, weight, bias), s.num_heads, s.num_kv_heads, s.head_dim, *norms,
                                       s.rms_norm_eps, cos, sin, batch.slot_mapping, k_cache, v_cache)
            return self._attend(i, q, batch, k_cache, v_cache)
        q, k, v = self._fused(x, f"{p}.qkv_proj")
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
        ops.write_kv(k_cache, v_cache, k, v, batch.slot_mapping, self.kernel_backend, may_skip=False)
        return self._attend(i, q, batch, k_cache, v_cache)

    def _attend(self, i: int, q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """Layer i's attention of the rotated queries `[T, h, d]` over the paged cache (this step's keys and values
        written), then o_proj -> `[T, H]`."""
        s, p = self.spec, f"model.layers.{i}.self_attn"
        sinks, window = self._get(f"{p}.sinks"), s.window(i)
        out = self._paged(q, batch, partial(ops.paged_decode_attention, sinks=sinks, window=window),
                          partial(ops.paged_prefill_attention, sinks=sinks, window=window), k_cache, v_cache)
        return self._linear(out.reshape(q.shape[0], s.num_heads * s.head_dim), f"{p}.o_proj")

    def _mla_attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Multi-head latent attention in the weight-absorbed form: the cache holds [latent | rotary key] per
        token; W_UK folds into the query, so attention reads only the latent cache, and W_UV maps the
        attended latent to values (the same for decode and prefill)."""
        s, m, p = self.spec, self.spec.mla, f"model.layers.{i}.self_attn"
        T, h = x.shape[0], s.num_heads
        if m.q_lora_rank:
            q = rms_norm(self._linear(x, f"{p}.q_a_proj"), self.w[f"{p}.q_a_layernorm.weight"], MLA_NORM_EPS)
            q = self._linear(q, f"{p}.q_b_proj")
        else:
            q = self._linear(x, f"{p}.q_proj")
        split = [m.qk_nope_head_dim, m.qk_rope_head_dim]
        q_nope, q_pe = q.view(T, h, sum(split)).split(split, dim=-1)
        compressed = self._linear(x, f"{p}.kv_a_proj_with_mqa")
        latent, k_pe = compressed.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.w[f"{p}.kv_a_layernorm.weight"], MLA_NORM_EPS)
        q_pe = _rope(q_pe, cos, sin, s.rope_interleave)
        k_pe = _rope(k_pe[:, None], cos, sin, s.rope_interleave)
        (cache,) = kv.layer(i)
        ops.write_latent(cache, torch.cat((latent[:, None], k_pe), dim=-1), batch.slot_mapping, may_skip=False)
        w_uk, w_uv = self.absorbed[i]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)            # [T, h, c]
        query = torch.cat((q_latent, q_pe), dim=-1)                                     # [T, h, c + r]
        out = self._paged(query, batch, partial(ops.paged_mla_decode, v_dim=m.kv_lora_rank),
                          partial(ops.paged_mla_prefill, v_dim=m.kv_lora_rank), cache,
                          out_dim=m.kv_lora_rank)                                       # [T, h, c]
        out = torch.bmm(out.transpose(0, 1), w_uv).transpose(0, 1)                      # [T, h, v]
        return self._linear(out.reshape(T, h * m.v_head_dim), f"{p}.o_proj")

    def _paged(self, q: torch.Tensor, batch: ForwardBatch, decode_op, prefill_op, *caches,
               out_dim: int | None = None) -> torch.Tensor:
        """Attention of the batch's decode rows (first) and prefill rows over the paged cache(s) -> `[T, h,
        out_dim]` (default: q's head dim)."""
        nd, dec, pre = batch.num_decodes, batch.decode, batch.prefill
        parts = []
        if dec is not None:
            parts.append(decode_op(q[:nd], *caches, dec.block_tables, dec.context_lens, self.scale,
                                   self.kernel_backend, max_context_len=dec.max_context_len, plan=dec.plan))
        if pre is not None:
            parts.append(prefill_op(q[nd:], *caches, pre.block_tables, pre.cu_seqlens_q, pre.context_lens,
                                    self.scale, self.kernel_backend, host_cu_seqlens=pre.host_cu_seqlens,
                                    host_context_lens=pre.host_context_lens))
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else q.new_empty(0, q.shape[1], out_dim or q.shape[2])

    def rope_tables(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' rotary module at these positions -> (cos, sin) `[T, 1, rd]` in rotate-half form. The
        DeepSeek-V2 module returns complex frequencies; they become the same form."""
        out = self.rotary(h[None], positions[None])
        if isinstance(out, torch.Tensor):
            cos, sin = out[0].real, out[0].imag
            cos, sin = torch.cat((cos, cos), dim=-1).to(h.dtype), torch.cat((sin, sin), dim=-1).to(h.dtype)
        else:
            cos, sin = out[0][0], out[1][0]
            if self.spec.rope_half_tables:   # GPT-OSS: one angle per pair
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos[:, None, :], sin[:, None, :]

    def _layers(self, batch: ForwardBatch, kv: KVCache):
        """The forward of one micro-batch as a generator: at each MoE layer it yields (moe_layer, x `[T, H]`,
        ids `[T, K]`, weights `[T, K]`), is resumed (sent None) once the dispatch has started, computes what
        needs no routed expert (the shared expert) while the experts work, yields None, and is sent back the
        routed-expert output `[T, H]`; it returns the logits `[len(batch.logit_rows), V]` fp32 and, when
        keep_hidden, the final-normed hidden state of every row `[T, H]` (what the MTP layer reads), else None."""
        h = F.embedding(batch.input_ids, self.w["model.embed_tokens.weight"])
        cos, sin = self.rope_tables(h, batch.positions)
        moe_layer = 0
        delta = None      # what the residual stream h still has to add: each sublayer's output joins its next norm
        for i in range(self.spec.num_layers):
            h, delta = yield from self.layer(i, moe_layer, h, delta, cos, sin, batch, kv)
            moe_layer += self.spec.moe_layers[i]
        rows = batch.logit_rows
        if keep := self.keep_hidden:
            _, normed = self._add_norm(h, delta, "model.norm.weight")
            h = normed[rows]
        else:
            _, h = self._add_norm(h[rows], None if delta is None else delta[rows], "model.norm.weight")
        return F.linear(h, self.lm_head).float(), normed if keep else None

    def layer(self, i: int, moe_layer: int, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, batch: ForwardBatch, kv: KVCache):
        """Decoder layer i (MoE layer moe_layer if its FFN is routed) as a generator that yields as `_layers` says;
        h: the residual stream, delta: what it still has to add -> (h, delta) after the layer."""
        s, p = self.spec, f"model.layers.{i}"
        attention = self._mla_attention if s.mla else self._attention
        h, x = self._add_norm(h, delta, f"{p}.input_layernorm.weight")
        h, x = self._add_norm(h, attention(i, x, cos, sin, batch, kv), f"{p}.post_attention_layernorm.weight")
        if not s.moe_layers[i]:
            return h, self._mlp(x, f"{p}.mlp")
        m = s.moe_prefix(i)
        r = f"{m}.{s.router_module}"
        weights, ids = route(s, x, self.w[f"{r}.weight"], self._get(f"{r}.e_score_correction_bias"),
                             self._get(f"{r}.bias"))
        yield moe_layer, x, ids, weights
        shared = None
        if s.shared_expert_size:   # overlaps the experts' round trip
            shared = self._mlp(x, f"{m}.{s.shared_module}")
            if s.shared_expert_gate:
                shared = torch.sigmoid(F.linear(x, self.w[f"{m}.shared_expert_gate.weight"])) * shared
        out = yield None
        return h, out if shared is None else out + shared

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the RMSNorm after it: (h + delta, or h when delta is None; its norm). In C the add
        is done in h's storage."""
        w, eps = self.w[weight], self.spec.rms_norm_eps
        if self.c_norms:
            if delta is not None and delta.stride(-1) != 1:
                delta = delta.contiguous()
            return h, cpu_ops.add_rms_norm(h, delta, w, eps)
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, w, eps)

    @torch.inference_mode()
    def forward(self, batches: list[ForwardBatch], kv: KVCache, moe: MoEContext) -> torch.Tensor:
        """Run micro-batches as a ping-pong pipeline: while the experts serve one micro-batch's layer, this
        rank computes another's attention. Every micro-batch joins every MoE layer's dispatch and combine,
        even with no tokens. Per layer the collectives go out as: dispatch mb 0..M-1, then combine
        mb 0..M-1 (expert ranks follow the same order). Returns the logits of all micro-batches, in order. With
        decode graphs (attention_nodes/graphs.py), a decode micro-batch replays them (captured here, before the
        step's first exchange, when its bucket has none yet)."""
        results = self.run([self._graphed(j, b, kv) for j, b in enumerate(batches)], moe)
        if self.keep_hidden:
            self.hidden = torch.cat([r[1] for r in results])
        return torch.cat([r[0] for r in results])

    def _graphed(self, j: int, batch: ForwardBatch, kv: KVCache):
        graphs = self.graphs
        if graphs is not None and kv is graphs.kv and graphs.takes(j, batch):
            try:
                return graphs.layers(j, batch)
            except Exception as e:     # noqa: BLE001 (graphs off, said once: the step runs eagerly)
                capture_failed(graphs, e)
        return self._layers(batch, kv)

    def run(self, gens: list, moe: MoEContext) -> list:
        """Drive micro-batch generators (each as `_layers` yields) through every MoE layer's dispatch and combine
        in the ping-pong order `forward` describes -> their return values, in order."""
        M = len(gens)
        logits: list = [None] * M
        # Step 1: each micro-batch runs to its first MoE layer; its dispatch starts at once.
        pending = [self._advance(gens[j], None, moe, logits, j) for j in range(M)]
        # Step 2: per layer, combine each micro-batch and compute its next attention while the experts
        # work on the following micro-batches; the next layer's dispatches start after every combine.
        while pending[0] is not None:
            ready = []
            for j in range(M):
                out = moe.finish(pending[j])
                ready.append(self._next(gens[j], out, logits, j, moe) if j < M - 1 else out)
            pending = [None if r is None else self._start(gens[j], r, moe) for j, r in enumerate(ready[:-1])]
            pending.append(self._advance(gens[-1], ready[-1], moe, logits, M - 1))
        return logits

    @staticmethod
    def _next(gen, value, logits: list, j: int, moe: MoEContext):
        """Resume a micro-batch up to its next MoE layer -> its request, or None once it has its logits. The
        time it computes goes to the comm stats, under that MoE layer (-1: the tail up to the logits)."""
        t0 = moe.dispatcher.stats.now()
        try:
            request = gen.send(value)
        except StopIteration as stop:
            logits[j] = stop.value
            moe.dispatcher.stats.add_compute(-1, t0, moe.dispatcher.stats.now())
            return None
        moe.dispatcher.stats.add_compute(request[0], t0, moe.dispatcher.stats.now())
        return request

    def _advance(self, gen, value, moe: MoEContext, logits: list, j: int) -> PendingDispatch | None:
        request = self._next(gen, value, logits, j, moe)
        return None if request is None else self._start(gen, request, moe)

    @staticmethod
    def _start(gen, request, moe: MoEContext) -> PendingDispatch:
        """Start a micro-batch's dispatch, then let it compute what needs no routed expert while the experts
        work (its time goes to the comm stats under that MoE layer, as compute)."""
        pending = moe.start(*request)
        t0 = moe.dispatcher.stats.now()
        assert gen.send(None) is None
        moe.dispatcher.stats.add_compute(request[0], t0, moe.dispatcher.stats.now())
        return pending


def _fuse_projections(w: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, list[int]]]:
    """Fuse, at load time, the projections that read the same input: q/k/v (-> "<attn>.qkv_proj") and an MLP's
    gate/up (-> "<mlp>.gate_up_proj"), as (weight, bias or None, output sizes). The parts leave `w` (no second
    copy). Each output is the same dot product as before, so results do not change."""
    fused = {}
    for parts, name in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
        heads = [k[:-len(parts[0]) - len(".weight")] for k in w if k.endswith(f".{parts[0]}.weight")]
        for prefix in heads:
            names = [f"{prefix}{p}" for p in parts]
            if not all(f"{n}.weight" in w for n in names):
                continue
            weights = [w.pop(f"{n}.weight") for n in names]
            biases = [w.pop(f"{n}.bias", None) for n in names]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else wt.new_zeros(wt.shape[0]) for b, wt in zip(biases, weights)])
            fused[f"{prefix}{name}"] = (torch.cat(weights), bias, [wt.shape[0] for wt in weights])
    return fused


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x `[T, heads, d]`, cos/sin `[T, 1, rd]` (rd <= d; rotate-half form). The first rd channels rotate
    (GLM's partial rotary leaves the rest as they are). interleaved: the pairs are (x0, x1), (x2, x3), ...
    (DeepSeek); they are de-interleaved first, as transformers does, so the result is in rotate-half layout
    (queries and keys get the same layout, so their dot products are unchanged)."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = rd // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
