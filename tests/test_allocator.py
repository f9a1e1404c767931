"""BlockAllocator: exact block ids, ref counts, copy-on-write, exhaustion. No torch needed."""

import os
import sys

import pytest

from hf_paged.errors import PoolExhausted
from hf_paged.storage import BlockAllocator


def test_allocator_module_imports_no_torch():
    # The allocator is pure Python by design; importing it must not pull torch in.
    import subprocess

    import hf_paged.storage.allocator

    # hf_paged/__init__ and hf_paged/storage/__init__ import torch, so stand in empty packages for them.
    storage_dir = os.path.dirname(hf_paged.storage.allocator.__file__)
    code = (
        "import sys, types; sys.modules['torch'] = None\n"
        f"pkg = types.ModuleType('hf_paged'); pkg.__path__ = [{os.path.dirname(storage_dir)!r}]\n"
        f"storage = types.ModuleType('hf_paged.storage'); storage.__path__ = [{storage_dir!r}]\n"
        "sys.modules['hf_paged'], sys.modules['hf_paged.storage'] = pkg, storage\n"
        "import hf_paged.storage.allocator\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_takes_ids_in_fifo_order():
    allocator = BlockAllocator(6)
    assert allocator.allocate(2) == [0, 1]
    assert allocator.allocate(3) == [2, 3, 4]
    assert allocator.num_free_blocks == 1
    assert allocator.num_used_blocks == 5
    allocator.free([1, 3])
    # Freed blocks go to the back of the queue: 5 first, then 1, then 3.
    assert allocator.allocate(3) == [5, 1, 3]
    allocator.check_invariants()


def test_allocate_zero_is_a_no_op():
    allocator = BlockAllocator(2)
    assert allocator.allocate(0) == []
    assert allocator.num_free_blocks == 2


def test_exhaustion_names_numbers_and_changes_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(PoolExhausted, match=r"need 2 blocks, 1 free of 4") as info:
        allocator.allocate(2)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.num_needed, info.value.num_free, info.value.num_total) == (2, 1, 4)
    assert allocator.num_free_blocks == 1
    assert allocator.allocate(1) == [3]
    allocator.check_invariants()


def test_ref_counts_share_and_free():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(2)
    allocator.incref([a, b])
    allocator.incref([a])
    assert (allocator.ref_count(a), allocator.ref_count(b)) == (3, 2)
    allocator.free([a, b])
    assert (allocator.ref_count(a), allocator.ref_count(b)) == (2, 1)
    assert allocator.num_free_blocks == 2
    allocator.free([b])
    assert allocator.ref_count(b) == 0
    assert allocator.num_free_blocks == 3
    allocator.free([a], times=2)
    assert allocator.num_free_blocks == 4
    allocator.check_invariants()


def test_allocate_with_several_holders():
    allocator = BlockAllocator(3)
    assert allocator.allocate(2, num_holders=4) == [0, 1]
    assert allocator.ref_count(0) == 4
    allocator.free([0, 1], times=4)
    assert allocator.num_free_blocks == 3


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(3)
    a, b = allocator.allocate(2)
    allocator.free([a])
    with pytest.raises(RuntimeError, match=f"double free of block {a}"):
        allocator.free([b, a])
    # b was not freed by the failed call.
    assert allocator.ref_count(b) == 1
    with pytest.raises(RuntimeError, match="double free"):
        allocator.free([b, b])
    assert allocator.ref_count(b) == 1
    allocator.check_invariants()


def test_incref_of_free_block_raises():
    allocator = BlockAllocator(2)
    with pytest.raises(RuntimeError, match="incref of free block 0"):
        allocator.incref([0])


def test_copy_on_write_keeps_exclusive_blocks_and_moves_shared_ones():
    allocator = BlockAllocator(4)
    (a,) = allocator.allocate(1)
    assert allocator.copy_on_write(a) == a  # sole holder: write in place
    allocator.incref([a])
    new = allocator.copy_on_write(a)
    assert new == 1
    assert (allocator.ref_count(a), allocator.ref_count(new)) == (1, 1)
    # A group of 3 holders out of 5 moves together.
    allocator.incref([a], times=4)
    moved = allocator.copy_on_write(a, num_holders=3)
    assert moved == 2
    assert (allocator.ref_count(a), allocator.ref_count(moved)) == (2, 3)
    allocator.check_invariants()


def test_copy_on_write_exhausted_changes_nothing():
    allocator = BlockAllocator(1)
    (a,) = allocator.allocate(1)
    allocator.incref([a])
    with pytest.raises(PoolExhausted):
        allocator.copy_on_write(a)
    assert allocator.ref_count(a) == 2


def test_grow_appends_free_ids():
    allocator = BlockAllocator(2)
    allocator.allocate(2)
    allocator.grow(3)
    assert allocator.num_blocks == 5
    assert allocator.allocate(3) == [2, 3, 4]
    allocator.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4"])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        BlockAllocator(bad)


def test_bad_allocate_arguments_are_rejected():
    allocator = BlockAllocator(2)
    with pytest.raises(ValueError):
        allocator.allocate(-1)
    with pytest.raises(ValueError):
        allocator.allocate(1, num_holders=0)


def test_creating_an_allocator_costs_the_same_for_any_num_blocks():
    import tracemalloc

    tracemalloc.start()
    allocator = BlockAllocator(10**12)
    assert allocator.allocate(3) == [0, 1, 2]
    allocator.free([1])
    assert allocator.allocate(2) == [3, 4]  # never-used ids come first: they were queued before 1 was freed
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert allocator.num_free_blocks == 10**12 - 4 and allocator.num_used_blocks == 4
    allocator.check_invariants()


@pytest.mark.parametrize(
    "allocated, freed, queue",
    [
        (4, [2], [2, 4, 5]),  # grown ids queue behind the freed block
        (2, [], [2, 3, 4, 5]),  # the never-used run goes on
        (2, [0], [2, 3, 0, 4, 5]),
        (4, [], [4, 5]),
    ],
)
def test_grow_queues_new_ids_last(allocated, freed, queue):
    allocator = BlockAllocator(4)
    allocator.allocate(allocated)
    allocator.free(freed)
    allocator.grow(2)
    assert allocator.free_queue() == queue
    allocator.check_invariants()
    assert allocator.allocate(len(queue)) == queue


def test_a_blocks_hash_packs_its_tokens_as_8_byte_little_endian_integers():
    import hashlib

    from hf_paged.storage.allocator import hash_block_tokens

    tokens = [0, 1, -3, 2**40, 128255]
    digest = hashlib.sha256(b"parent")
    digest.update((2).to_bytes(8, "little"))
    digest.update(b"".join(token.to_bytes(8, "little", signed=True) for token in tokens))
    assert hash_block_tokens(b"parent", 2, tokens) == digest.digest()
    assert hash_block_tokens(b"parent", 2, tuple(tokens)) == digest.digest()
    with pytest.raises(ValueError, match="64 bits"):
        hash_block_tokens(None, 0, [2**63])


def test_a_spare_block_is_one_that_caches_nothing_when_there_is_one():
    allocator = BlockAllocator(4, enable_prefix_caching=True)
    blocks = allocator.allocate(3)
    for block_id, block_hash in zip(blocks[:2], (b"a" * 32, b"b" * 32)):
        allocator.cache_block(block_id, block_hash)
    allocator.free(blocks)  # queue: 3 (never used), then 0 and 1 (cached), 2 (caches nothing)
    assert allocator.allocate_spare() == 2  # the least recently freed block that caches nothing
    assert allocator.allocate_spare() == 3  # then a never-used one
    assert allocator.allocate_spare() == 0 and allocator.num_cached_blocks == 1  # then the LRU cached one, evicted
    assert allocator.allocate_spare() == 1 and allocator.allocate_spare() is None
    allocator.check_invariants()
