"""The paged KV tensor of one attention rank: `[L, C, num_blocks, block_size, heads, dim]`, where (C, heads, dim)
is the spec's `kv_entry`: (2, kv_heads, head_dim) for K and V, (1, 1, kv_lora_rank + qk_rope_head_dim) for an
MLA latent entry."""
from __future__ import annotations

import torch

from kernels.paged_attention import kv_bits

from .host_tier import SAVE


def block_bytes(num_layers: int, block_size: int, entry: tuple[int, int, int], dtype: torch.dtype) -> int:
    """Bytes one block takes over num_layers layers; entry: (components, heads, dim) per token and layer."""
    c, heads, dim = entry
    return num_layers * c * block_size * heads * dim * dtype.itemsize


def num_blocks_for(memory_bytes: int, num_layers: int, block_size: int, entry: tuple[int, int, int],
                   dtype: torch.dtype, name: str = "kv_cache_memory") -> int:
    """How many blocks fit in memory_bytes; entry: (components, heads, dim) per token and layer."""
    per_block = block_bytes(num_layers, block_size, entry, dtype)
    n = memory_bytes // per_block
    if n < 1:
        raise ValueError(f"{name}={memory_bytes} bytes holds no KV block ({per_block} bytes each); "
                         f"give more memory")
    return int(n)


class KVCache:
    """host_blocks > 0 adds the host tier's tensor, the same layout in host memory (pinned on CUDA)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, entry: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, host_blocks: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        c, heads, dim = entry
        self.tensor = torch.zeros(num_layers, c, num_blocks, block_size, heads, dim, dtype=dtype, device=device)
        self.host = None
        if host_blocks:
            self.host = torch.zeros(num_layers, c, host_blocks, block_size, heads, dim, dtype=dtype,
                                    pin_memory=device.type == "cuda")

    def copy_device_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer) within the device cache: (source, destination) pairs, all sources
        distinct from all destinations (copy-on-write targets are fresh blocks)."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.tensor.device)
            dst = torch.tensor([c[1] for c in copies], device=self.tensor.device)
            bits = kv_bits(self.tensor)          # a float8 cache's blocks copied as bytes
            bits[:, :, dst] = bits[:, :, src]

    def copy_blocks(self, ops: list[tuple[int, int, int]]) -> None:
        """Run the host tier's copies in order: (SAVE, device block, host slot) or (LOAD, host slot, device block).
        Runs of one kind go as one indexed copy (a host slot saved twice in a run keeps the later block)."""
        i = 0
        while i < len(ops):
            j = i
            while j < len(ops) and ops[j][0] == ops[i][0]:
                j += 1
            last = {dst: src for _, src, dst in ops[i:j]}
            src, dst = torch.tensor(list(last.values())), torch.tensor(list(last))
            device, host = kv_bits(self.tensor), kv_bits(self.host)     # float8 blocks as bytes
            if ops[i][0] == SAVE:
                host[:, :, dst] = device[:, :, src.to(device.device)].to("cpu")
            else:
                device[:, :, dst.to(device.device)] = host[:, :, src].to(device.device)
            i = j

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's caches, each `[num_blocks, block_size, heads, dim]`: (k_cache, v_cache), or (latent,)."""
        return tuple(self.tensor[i].unbind(0))

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes in one layer."""
        _, c, _, _, heads, dim = self.tensor.shape
        return c * heads * dim * self.tensor.element_size()
