"""The paged KV tensor of one attention rank: `[L, 2, num_blocks, block_size, kv_heads, head_dim]`."""
from __future__ import annotations

import torch


def num_blocks_for(memory_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """How many blocks fit in memory_bytes."""
    per_block = num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
    n = memory_bytes // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory={memory_bytes} bytes holds no KV block ({per_block} bytes each); "
                         f"give more memory")
    return int(n)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        return self.tensor[i, 0], self.tensor[i, 1]
