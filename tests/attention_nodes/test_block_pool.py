"""BlockPool: allocation, refcounts, free list and argument errors."""
import pytest

from attention_nodes.block_pool import BlockPool


def make_pool(num_blocks: int = 8, block_size: int = 4) -> BlockPool:
    return BlockPool(num_blocks, block_size)


def test_fresh_pool_is_all_free():
    pool = make_pool(8, 4)
    assert (pool.num_blocks, pool.block_size) == (8, 4)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    assert BlockPool(3).block_size == 16


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_is_ceil_division(num_tokens, expected):
    assert make_pool(block_size=4).blocks_needed(num_tokens) == expected


def test_allocate_gives_distinct_ids_with_refcount_one():
    pool = make_pool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert sorted(a + b) == list(range(8))
    assert all(pool.refcount(i) == 1 for i in a + b)
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 8
    assert pool.can_allocate(0) and not pool.can_allocate(1)
    assert pool.allocate(0) == []


def test_allocate_too_many_raises_naming_counts():
    pool = make_pool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match=r"n=2.*only 1 of 4"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # failed allocation takes nothing


def test_free_returns_blocks_for_reuse():
    pool = make_pool(4)
    ids = pool.allocate(4)
    pool.free(ids[:2])
    assert pool.num_free_blocks == 2
    assert all(pool.refcount(i) == 0 for i in ids[:2])
    assert sorted(pool.allocate(2)) == sorted(ids[:2])


def test_incref_keeps_block_until_last_free():
    pool = make_pool(4)
    [b] = pool.allocate(1)
    pool.incref([b])
    assert pool.refcount(b) == 2
    pool.free([b])
    assert pool.refcount(b) == 1 and pool.num_free_blocks == 3
    pool.free([b])
    assert pool.refcount(b) == 0 and pool.num_free_blocks == 4


def test_double_free_and_incref_of_free_block_are_internal_errors():
    pool = make_pool(4)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])
    with pytest.raises(AssertionError, match="incref of free block"):
        pool.incref([b])


@pytest.mark.parametrize("kwargs, name", [
    ({"num_blocks": 0}, "num_blocks=0"),
    ({"num_blocks": -3}, "num_blocks=-3"),
    ({"num_blocks": 4, "block_size": 0}, "block_size=0"),
    ({"num_blocks": True}, "num_blocks=True"),
])
def test_bad_constructor_args_raise_value_error(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BlockPool(**kwargs)


def test_bad_counts_raise_value_error():
    pool = make_pool()
    with pytest.raises(ValueError, match="n=-1"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        pool.blocks_needed(-1)
