"""Paged KV-cache block allocator with a prefix cache: per-block reference counts, and full blocks kept
under the hash of their contents after their last holder lets go, until the pool needs them back.

The pool owns block ids only; the KV tensors live with the model runner, which indexes them by the ids
handed out here. A block holds `block_size` tokens.

A full block's key chains the key of the block before it with its own token ids (`hash_block`), so equal
keys mean equal whole prefixes, and a prefix's KV can be reused wherever those tokens appear again.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .host_tier import HostTier


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockPool {name}={value!r} is invalid: pass an integer >= 1")


def hash_block(parent: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """The key of a full block: 64 bits of BLAKE2b over the parent block's key and this block's token ids; a
    salted chain's first block (salt: its request's cache_salt) hashes the salt instead of a parent, under a marker
    of its own, so its key cannot be any unsalted chain's. The same in every process (Python's own hash of a tuple
    is too, but it is 61 bits on some builds and not meant to be collision-resistant)."""
    h = hashlib.blake2b(digest_size=8)
    if salt is not None:
        data = salt.encode()
        h.update(b"\x02" + len(data).to_bytes(8, "little") + data)
    else:
        h.update((parent if parent is not None else 0).to_bytes(8, "little"))
        h.update(b"\x01" if parent is not None else b"\x00")
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: Sequence[int], block_size: int, known: list[int] | None = None,
                 limit: int | None = None, salt: str | None = None) -> list[int]:
    """Keys of the full blocks of token_ids (at most `limit` of them), extending `known` (the keys already
    computed for a prefix of the same tokens) in place when it is given. salt (a request's cache_salt, vLLM's):
    in the first block's key, so the chain, and so the cache, is shared only by requests with the same."""
    keys = known if known is not None else []
    n = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    while len(keys) < n:
        i = len(keys)
        block = token_ids[i * block_size:(i + 1) * block_size]
        keys.append(hash_block(keys[-1], block) if keys else hash_block(None, block, salt))
    return keys


class BlockPool:
    """Hands out block ids 0..num_blocks-1 and takes them back when their refcount hits 0.

    refcount 0 <=> the block is in the free queue. Refcounts above 1 let several sequences share a block
    (a cached prefix); `free` only returns a block once the last holder lets go. Free blocks are reused
    least-recently-freed first; a cached block (one that has a key) stays findable by `lookup` until it is
    reused, which evicts it (to the host tier when there is one). `take_events` drains the keys added and
    evicted since its last call (the leader's view of this rank's cache).
    """

    __slots__ = ("_free", "_refcounts", "block_size", "num_blocks", "_key_of", "_block_of", "host",
                 "_added", "_evicted", "track_events", "_copies")

    def __init__(self, num_blocks: int, block_size: int = 16, host: HostTier | None = None,
                 track_events: bool = False) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refcounts: list[int] = [0] * num_blocks
        self._key_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        self.host = host
        self.track_events = track_events
        self._added: dict[int, None] = {}      # an ordered set: a key added, then evicted, is in neither list
        self._evicted: list[int] = []
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are reused when needed)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by key, held or not."""
        return len(self._block_of)

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
        """Take `n` free blocks, each with refcount 1, evicting cached ones least recently freed first.
        Raises RuntimeError if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} is invalid: pass an integer >= 0")
        if n > len(self._free):
            raise RuntimeError(
                f"cannot allocate n={n} blocks: only {len(self._free)} of {self.num_blocks} are free; "
                "check can_allocate() first or free/preempt sequences")
        block_ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in block_ids:
            assert self._refcounts[b] == 0, f"block {b} in the free queue has refcount {self._refcounts[b]}"
            self._refcounts[b] = 1
            self._evict(b)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each of `block_ids`, which must already be allocated."""
        for b in block_ids:
            assert self._refcounts[b] > 0, f"incref of free block {b}"
            self._refcounts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each of `block_ids`; a block at refcount 0 joins the free queue's tail (pass a
        sequence's table reversed so its last blocks are reused first and its head stays cached longest)."""
        for b in block_ids:
            assert self._refcounts[b] > 0, f"double free of block {b}"
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free[b] = None

    def copy_block(self, block_id: int) -> int:
        """Copy on write: a fresh block that takes over one reference to `block_id` (whose content is copied into
        it before the next forward: `take_copies`). Needs one free block."""
        assert self._refcounts[block_id] > 1, f"copy of block {block_id}, which has no other holder"
        (new,) = self.allocate(1)
        self._copies.append((block_id, new))
        self.free([block_id])
        return new

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) device block copies decided since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    # ----- the prefix cache -------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` found on this pool (not yet taken)."""
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def holds(self, key: int) -> bool:
        """Whether a block of this pool is findable under key."""
        return key in self._block_of

    def num_revived(self, block_ids: Iterable[int]) -> int:
        """How many of these cached blocks are free now (taking them lowers num_free_blocks)."""
        return sum(self._refcounts[b] == 0 for b in block_ids)

    def take(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each cached block found by `lookup`, reviving free ones out of the free queue."""
        for b in block_ids:
            if self._refcounts[b] == 0:
                del self._free[b]
            self._refcounts[b] += 1

    def register(self, block_id: int, key: int) -> bool:
        """Make a full, held block findable under key. False (and nothing changes) when another block already
        holds that key (two sequences computed the same prefix at once) or this one has a key."""
        assert self._refcounts[block_id] > 0, f"register of free block {block_id}"
        if key in self._block_of or self._key_of[block_id] is not None:
            return False
        self._key_of[block_id] = key
        self._block_of[key] = block_id
        if self.track_events:
            self._added[key] = None
        return True

    def reset_cache(self) -> int:
        """vLLM's reset_prefix_cache: no block is findable by key any more, and the host tier is emptied -> the
        keys forgotten on the device. Held blocks stay with their holders (whose later full blocks are cached
        again, unreachable from a forgotten first block); free ones are reused without an eviction's copy. The
        pending events are dropped with them (the leader clears its view of this cache at the same time)."""
        n = len(self._block_of)
        for b in self._block_of.values():
            self._key_of[b] = None
        self._block_of.clear()
        self._added, self._evicted = {}, []
        if self.host is not None:
            self.host.clear()
        return n

    def take_events(self) -> tuple[list[int], list[int]]:
        """(keys added, keys evicted) since the last call, in order; a key added and evicted again since then is
        in neither (a reader that applies the evictions first, then the additions, sees the pool as it is)."""
        added, evicted = list(self._added), self._evicted
        self._added, self._evicted = {}, []
        return added, evicted

    def _evict(self, b: int) -> None:
        key = self._key_of[b]
        if key is None:
            return
        self._key_of[b] = None
        del self._block_of[key]
        if self.track_events:
            if key in self._added:
                del self._added[key]
            else:
                self._evicted.append(key)
        if self.host is not None:
            self.host.save(key, b)
