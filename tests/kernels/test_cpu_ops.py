"""The fused elementwise C ops (kernels/cpu_ops.py) against transformers' own modules: Qwen3-MoE's RMSNorm and its
rotary `apply_rotary_pos_emb`, and plain indexing for the cache writes. The residual add and the rotary embedding
are torch's bits; a normalised value may differ from transformers' in its last bits (the mean of squares is summed
in another order)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, apply_rotary_pos_emb

from kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler runs here")
EPS = 1e-6


def hf_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    module = Qwen3MoeRMSNorm(x.shape[-1], eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
        return module(x)


def assert_near_bits(got: torch.Tensor, want: torch.Tensor, ulps: int = 4) -> None:
    """Within a few units in the last place of the largest value of each row (a value that cancels to near zero
    keeps its terms' absolute error)."""
    spacing = torch.finfo(torch.float32).eps * want.abs().amax(-1, keepdim=True)
    bad = (got - want).abs() > ulps * spacing
    assert not bad.any(), f"{int(bad.sum())} values differ: max {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("rows,width", [(1, 256), (64, 256), (257, 256), (5, 60), (3, 7168), (0, 256)])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("scale", [1e-3, 3.0])
def test_add_rms_norm_is_transformers(rows, width, with_delta, scale):
    """Small rows too, where eps counts."""
    g = torch.Generator().manual_seed(rows * 1000 + width)
    h = torch.randn(rows, width, generator=g) * scale
    delta = torch.randn(rows, width, generator=g) * scale if with_delta else None
    weight = torch.randn(width, generator=g)
    want_h = h + delta if with_delta else h.clone()
    want = hf_norm(want_h, weight)
    got = cpu_ops.add_rms_norm(h, delta, weight, EPS)
    assert torch.equal(h, want_h)                  # the add, in h's storage, is torch's
    assert got.shape == want.shape
    assert_near_bits(got, want)


def test_add_rms_norm_takes_strided_rows_and_refuses_what_it_cannot_read():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 300, generator=g)
    h, delta = wide[:, :256], wide[:, 20:276]            # rows 300 floats apart
    weight = torch.randn(256, generator=g)
    want_h = h + delta
    got = cpu_ops.add_rms_norm(h, delta, weight, EPS)
    assert torch.equal(h, want_h)
    assert_near_bits(got, hf_norm(want_h, weight))
    with pytest.raises(ValueError, match="contiguous channels"):
        cpu_ops.add_rms_norm(torch.randn(256, 4).t(), None, weight, EPS)
    with pytest.raises(ValueError, match="fp32"):
        cpu_ops.add_rms_norm(torch.randn(4, 256, dtype=torch.bfloat16), None, weight, EPS)
    with pytest.raises(ValueError, match="does not match"):
        cpu_ops.add_rms_norm(torch.randn(4, 256), torch.randn(3, 256), weight, EPS)


def rope_tables(positions: torch.Tensor, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    angles = positions[:, None].float() * inv[None]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("heads,kv_heads,d,rd", [(4, 2, 64, 64), (8, 8, 32, 32), (4, 1, 64, 32), (2, 2, 8, 8)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_rope_write_is_transformers(heads, kv_heads, d, rd, qk_norm):
    """Qwen3's order: per-head norm of q and k, then the rotary embedding (of the first rd channels; the rest pass
    through, as GLM's partial rotary); keys and values land at their slots and nowhere else."""
    g = torch.Generator().manual_seed(heads * 100 + d + rd + qk_norm)
    T, blocks, bs = 37, 16, 4
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g) * 2
    q_w, k_w = (torch.randn(d, generator=g) if qk_norm else None for _ in range(2))
    positions = torch.randint(0, 500, (T,), generator=g)
    cos, sin = rope_tables(positions, rd)
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    k_cache = torch.randn(blocks, bs, kv_heads, d, generator=g)
    v_cache = torch.randn(blocks, bs, kv_heads, d, generator=g)
    before_k, before_v = k_cache.clone(), v_cache.clone()

    q = cpu_ops.qkv_rope_write(qkv, heads, kv_heads, d, q_w, k_w, EPS, cos, sin, slots, k_cache, v_cache)

    want_q, want_k, want_v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q, want_k = want_q.view(T, heads, d), want_k.view(T, kv_heads, d)
    if qk_norm:
        want_q, want_k = hf_norm(want_q, q_w), hf_norm(want_k, k_w)
    # transformers' layout is [batch, heads, T, d]; rotate the first rd channels only.
    rot_q, rot_k = apply_rotary_pos_emb(want_q[..., :rd].transpose(0, 1)[None], want_k[..., :rd].transpose(0, 1)[None],
                                        cos[None], sin[None])
    want_q = torch.cat((rot_q[0].transpose(0, 1), want_q[..., rd:]), dim=-1)
    want_k = torch.cat((rot_k[0].transpose(0, 1), want_k[..., rd:]), dim=-1)
    if qk_norm:
        assert_near_bits(q, want_q)
    else:
        assert torch.equal(q, want_q)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    if qk_norm:
        assert_near_bits(flat_k[slots], want_k)
    else:
        assert torch.equal(flat_k[slots], want_k)
    assert torch.equal(flat_v[slots], want_v.reshape(T, kv_heads, d))
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, kv_heads, d)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, kv_heads, d)[untouched])



@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_qkv_rope_write_into_a_float8_cache_stores_the_cast(dtype):
    """The same call into an fp32 cache and into a float8 one: the float8 slots hold torch's cast of the fp32
    slots' keys and values, bit for bit, the queries are the same, and no other slot changes."""
    g = torch.Generator().manual_seed(5)
    T, heads, kv_heads, d, blocks, bs = 13, 4, 2, 16, 8, 4
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g) * 200      # some keys beyond e4m3's 448
    q_w, k_w = torch.randn(d, generator=g), torch.randn(d, generator=g) * 300
    cos, sin = rope_tables(torch.randint(0, 500, (T,), generator=g), d)
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    wide = [torch.zeros(blocks, bs, kv_heads, d) for _ in range(2)]
    narrow = [torch.zeros(blocks, bs, kv_heads, d, dtype=dtype) for _ in range(2)]
    assert cpu_ops.supports_cache(*narrow, d)
    q = cpu_ops.qkv_rope_write(qkv, heads, kv_heads, d, q_w, k_w, EPS, cos, sin, slots, *wide)
    q8 = cpu_ops.qkv_rope_write(qkv, heads, kv_heads, d, q_w, k_w, EPS, cos, sin, slots, *narrow)
    assert torch.equal(q8, q)
    for w, n in zip(wide, narrow):
        assert torch.equal(n.view(torch.uint8), w.to(dtype).view(torch.uint8))
    assert float(wide[0].abs().max()) > 448

def test_qkv_rope_write_checks_its_shapes():
    cache = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match=r"not \[T, \(h \+ 2 kvh\) d\]"):
        cpu_ops.qkv_rope_write(torch.zeros(3, 40), 4, 2, 8, None, None, EPS, torch.zeros(3, 8), torch.zeros(3, 8),
                               torch.zeros(3, dtype=torch.int64), cache, cache.clone())
    assert cpu_ops.supports_cache(cache, cache, 8)
    assert not cpu_ops.supports_cache(cache, cache, 16)
    assert not cpu_ops.supports_cache(cache.to(torch.bfloat16), cache, 8)
    assert not cpu_ops.supports_cache(torch.zeros(4, 2, 4, 8).transpose(1, 2), cache, 8)


def random_batch(lengths: list[int], first_block: int, vocab: int, seed: int):
    """Prompt chunks of random tokens (so attention weights matter) with their own blocks -> ForwardBatch."""
    from attention_nodes.batch import ForwardBatch
    from attention_nodes.sampling_params import SamplingParams
    from attention_nodes.sequence import Sequence
    from attention_nodes.step_plan import ScheduledSeq

    g = torch.Generator().manual_seed(seed)
    scheduled, block = [], first_block
    for i, n in enumerate(lengths):
        seq = Sequence.from_request(f"r{seed}-{i}", torch.randint(3, vocab, (n,), generator=g).tolist(),
                                    SamplingParams(max_tokens=1), i)
        seq.block_table = list(range(block, block + -(-n // 16)))
        block += len(seq.block_table)
        scheduled.append(ScheduledSeq.from_seq(seq, n))
    return ForwardBatch.from_scheduled(scheduled, 16, torch.device("cpu"), "torch"), block


@pytest.mark.parametrize("arch,fused_qkv", [("qwen3_moe", True), ("olmoe", False), ("deepseek_v3", False)])
def test_the_model_takes_them_and_keeps_its_logits(tiny_checkpoint, monkeypatch, arch, fused_qkv):
    """AttentionModel on backend "cpu" calls the fused ops (Qwen3's per-head q/k norms included; OLMoE's norm over
    all heads and DeepSeek's MLA keep the torch q/k path but take the fused add + norm) and its logits equal the
    "torch" backend's to fp32 rounding, over prompt chunks of random tokens in two micro-batches."""
    from attention_nodes.kv_cache import KVCache
    from attention_nodes.model import AttentionModel
    from launch.runtime.memory import NoExperts
    from models.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_checkpoint(arch))
    spec, cpu = ckpt.spec, torch.device("cpu")
    calls = {"add_rms_norm": 0, "qkv_rope_write": 0}
    for name in calls:
        fn = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _fn=fn, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _fn(*a))
    first, blocks = random_batch([3, 9, 20], 0, spec.vocab_size, seed=1)
    second, blocks = random_batch([33, 1], blocks, spec.vocab_size, seed=2)
    logits = {}
    for backend in ("cpu", "torch"):
        model = AttentionModel(spec, ckpt.read(ckpt.attention_tensor_names(), torch.float32, cpu), cpu, backend)
        kv = KVCache(spec.num_layers, blocks, 16, spec.kv_entry, torch.float32, cpu)
        logits[backend] = model.forward([first, second], kv, NoExperts())
        if backend == "cpu":
            assert calls["add_rms_norm"] == 2 * (2 * spec.num_layers + 1)
            assert calls["qkv_rope_write"] == (2 * spec.num_layers if fused_qkv else 0)
    assert calls["add_rms_norm"] == 2 * (2 * spec.num_layers + 1)     # the torch backend called none
    assert logits["cpu"].shape == (5, spec.vocab_size)
    torch.testing.assert_close(logits["cpu"], logits["torch"], rtol=1e-4, atol=1e-4)
