"""KV pool block allocator (pure Python)."""

import pytest

from engine.core.blocks import BlockAllocator, num_blocks_for


def test_grows_by_doubling_up_to_the_cap_and_allocates_lowest_first():
    blocks = BlockAllocator(block_size=256, max_blocks=10)
    assert num_blocks_for(257, 256) == 2 and num_blocks_for(256, 256) == 1
    assert blocks.allocate(1) is None  # the pool starts empty
    assert blocks.growth_target(3) == 3
    blocks.grow(3)
    assert blocks.growth_target(3) is None
    a = blocks.allocate(2)
    assert a == [0, 1] and blocks.num_free == 1 and blocks.num_used == 2
    assert blocks.growth_target(2) == 6  # doubles: 3 -> 6
    blocks.grow(6)
    b = blocks.allocate(4)
    assert b == [2, 3, 4, 5]
    blocks.free(a)
    assert blocks.allocate(1) == [0]
    assert blocks.growth_target(5) == 10  # 12 would pass the cap
    with pytest.raises(RuntimeError, match="max_blocks=10"):
        blocks.growth_target(10)
    with pytest.raises(ValueError):
        blocks.grow(11)


def is_run(blocks):
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def test_allocates_the_lowest_run_of_consecutive_blocks_when_there_is_one():
    blocks = BlockAllocator(block_size=16, max_blocks=16)
    blocks.grow(10)
    a, b, c = blocks.allocate(2), blocks.allocate(3), blocks.allocate(2)
    assert (a, b, c) == ([0, 1], [2, 3, 4], [5, 6])
    blocks.free(a)
    blocks.free(c)  # free: 0 1 . . . 5 6 7 8 9
    assert blocks.allocate(3) == [5, 6, 7]  # the lowest run of 3 skips the run 0-1, too short
    assert blocks.allocate(2) == [0, 1]  # the lowest run of 2
    assert blocks.allocate(1) == [8]
    assert blocks.num_free == 1 and blocks.num_used == 9


def test_falls_back_to_the_lowest_free_blocks_when_fragmented():
    blocks = BlockAllocator(block_size=16, max_blocks=8)
    blocks.grow(8)
    singles = [blocks.allocate(1) for _ in range(8)]
    for s in singles[::2]:
        blocks.free(s)  # free: 0 2 4 6, no two consecutive
    assert blocks.allocate(3) == [0, 2, 4]  # no run of 3: the lowest three
    assert blocks.allocate(2) is None  # one free block left
    assert blocks.allocate(1) == [6]


def test_freed_blocks_are_reused_and_merge_into_runs():
    blocks = BlockAllocator(block_size=16, max_blocks=12)
    blocks.grow(6)
    a, b, c = blocks.allocate(2), blocks.allocate(2), blocks.allocate(2)
    blocks.free(list(reversed(b)))  # order does not matter
    blocks.free(a)  # 0-3 free again: one run
    assert blocks.allocate(4) == [0, 1, 2, 3]
    blocks.free([0, 1, 2, 3])
    blocks.free(c)
    assert blocks.num_free == 6 and blocks.num_used == 0
    blocks.grow(12)  # new blocks extend the run
    assert blocks.allocate(12) == list(range(12))
    assert blocks.allocate(0) == []


def test_random_allocations_never_hand_out_a_block_twice():
    import random

    rng = random.Random(0)
    blocks = BlockAllocator(block_size=4, max_blocks=64)
    blocks.grow(64)
    held = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            blocks.free(held.pop(rng.randrange(len(held))))
        else:
            got = blocks.allocate(rng.randint(1, 6))
            if got is not None:
                held.append(got)
        owned = [b for h in held for b in h]
        assert len(owned) == len(set(owned)) and blocks.num_used == len(owned)
    assert sum(is_run(h) for h in held) >= 1
