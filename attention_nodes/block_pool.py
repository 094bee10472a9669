"""Paged KV-cache block allocator: a free list plus per-block reference counts.

The pool owns block ids only; the KV tensors live with the model runner, which
indexes them by the ids handed out here. A block holds `block_size` tokens.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockPool {name}={value!r} is invalid: pass an integer >= 1")


class BlockPool:
    """Hands out block ids 0..num_blocks-1 and takes them back when their refcount hits 0.

    refcount 0 <=> the block is on the free list. Refcounts above 1 let several
    sequences share a block (e.g. a future prefix cache); `free` only returns the
    block once the last holder lets go.
    """

    __slots__ = ("_free", "_refcounts", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        """Current number of holders of `block_id` (0 = free)."""
        return self._refcounts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold `num_tokens` tokens (ceil division)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r} is invalid: pass an integer >= 0")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with refcount 1. Raises RuntimeError if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} is invalid: pass an integer >= 0")
        if n > len(self._free):
            raise RuntimeError(
                f"cannot allocate n={n} blocks: only {len(self._free)} of {self.num_blocks} are free; "
                "check can_allocate() first or free/preempt sequences")
        block_ids = [self._free.popleft() for _ in range(n)]
        for b in block_ids:
            assert self._refcounts[b] == 0, f"block {b} on the free list has refcount {self._refcounts[b]}"
            self._refcounts[b] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each of `block_ids`, which must already be allocated."""
        for b in block_ids:
            assert self._refcounts[b] > 0, f"incref of free block {b}"
            self._refcounts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each of `block_ids`; a block at refcount 0 goes back on the free list."""
        for b in block_ids:
            assert self._refcounts[b] > 0, f"double free of block {b}"
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free.append(b)
