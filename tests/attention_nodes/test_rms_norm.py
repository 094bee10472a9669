"""rms_norm: transformers' own RMSNorm module is the oracle, bit for bit in fp32 (where the fast path runs) and
in bf16 (where transformers' casts are kept)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from attention_nodes.model import rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256), (64, 256), (33, 4, 64), (3, 576), (17, 7168)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_rms_norm_is_transformers_bit_for_bit(dtype, shape, scale):
    g = torch.Generator().manual_seed(shape[-1] + int(scale * 10))
    x = (torch.randn(*shape, generator=g) * scale).to(dtype)
    module = Qwen3MoeRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(shape[-1], generator=g))
        want = module(x)
    assert torch.equal(rms_norm(x, module.weight.detach(), 1e-6), want)
