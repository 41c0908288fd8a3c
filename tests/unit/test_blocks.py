"""KV pool block allocator (pure Python)."""

import pytest

from engine.blocks import BlockAllocator, num_blocks_for


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
