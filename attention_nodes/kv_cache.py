"""The paged KV tensor of one attention rank: `[L, C, num_blocks, block_size, heads, dim]`, where (C, heads, dim)
is the spec's `kv_entry`: (2, kv_heads, head_dim) for K and V, (1, 1, kv_lora_rank + qk_rope_head_dim) for an
MLA latent entry."""
from __future__ import annotations

import torch


def num_blocks_for(memory_bytes: int, num_layers: int, block_size: int, entry: tuple[int, int, int],
                   dtype: torch.dtype) -> int:
    """How many blocks fit in memory_bytes; entry: (components, heads, dim) per token and layer."""
    c, heads, dim = entry
    per_block = num_layers * c * block_size * heads * dim * dtype.itemsize
    n = memory_bytes // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory={memory_bytes} bytes holds no KV block ({per_block} bytes each); "
                         f"give more memory")
    return int(n)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, entry: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        c, heads, dim = entry
        self.tensor = torch.zeros(num_layers, c, num_blocks, block_size, heads, dim, dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's caches, each `[num_blocks, block_size, heads, dim]`: (k_cache, v_cache), or (latent,)."""
        return tuple(self.tensor[i].unbind(0))

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes in one layer."""
        _, c, _, _, heads, dim = self.tensor.shape
        return c * heads * dim * self.tensor.element_size()
