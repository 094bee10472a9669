"""The host-memory KV tier: bounded copies of cached blocks the device pool evicted, so that a later hit
restores them with a copy instead of recomputing them (Mooncake's DRAM tier, on one rank).

This class keeps the books only: which block key sits in which host slot, least recently used first, and the
copies still to make. The KV cache makes the copies (`KVCache.copy_blocks`) before the step's forward, in the
order they were recorded, so a block is saved before the step overwrites it and restored before it is read.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

SAVE, LOAD = 0, 1   # op kinds: (SAVE, device block, host slot) / (LOAD, host slot, device block)


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"HostTier num_blocks={num_blocks!r} is invalid: pass an integer >= 1")
        self.num_blocks = num_blocks
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # key -> host slot, least recently used first
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._pinned: set[int] = set()
        self._ops: list[tuple[int, int, int]] = []
        self.num_saved = 0        # blocks copied to the host
        self.num_restored = 0     # blocks copied back instead of recomputed

    def __contains__(self, key: int) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def save(self, key: int, block: int) -> None:
        """The device pool is reusing `block`, which holds `key`: keep a host copy (evicting the least recently
        used unpinned one when full). Nothing happens when the host already has the key or every slot is pinned."""
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((k for k in self._slot_of if k not in self._pinned), None)
            if victim is None:
                return
            slot = self._slot_of.pop(victim)
        self._slot_of[key] = slot
        self._ops.append((SAVE, block, slot))
        self.num_saved += 1

    def match(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, the host holds."""
        n = 0
        for k in keys:
            if k not in self._slot_of:
                break
            n += 1
        return n

    def pin(self, keys: Sequence[int]) -> None:
        """Keep these keys' slots from being reused until `restore` (the device blocks they go to are being
        allocated, which may save other blocks here)."""
        self._pinned.update(keys)

    def unpin(self, keys: Sequence[int]) -> None:
        self._pinned.difference_update(keys)

    def restore(self, keys: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy each pinned key's host slot into the matching device block; the keys stay here too (most recently
        used), so evicting the device blocks again costs no copy."""
        for key, block in zip(keys, blocks, strict=True):
            slot = self._slot_of[key]
            self._slot_of.move_to_end(key)
            self._ops.append((LOAD, slot, block))
        self.num_restored += len(keys)
        self.unpin(keys)

    def clear(self) -> None:
        """Forget every block (between steps: none is pinned, and the copies still to make only save blocks into
        slots that a later save may reuse, after them)."""
        assert not self._pinned, f"host tier cleared with {len(self._pinned)} keys pinned mid-restore"
        self._slot_of.clear()
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))

    def take_ops(self) -> list[tuple[int, int, int]]:
        ops, self._ops = self._ops, []
        return ops
