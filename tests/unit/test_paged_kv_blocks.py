"""Unit tests of the paged KV cache's bookkeeping (services/rollout/engine_torch/paged/blocks.py): block tables,
copy-on-write forks, the prefix cache's hash chains, LRU eviction and weight-version invalidation."""

from __future__ import annotations

import pytest

from services.rollout.engine_torch.paged.blocks import BlockPool, BlockTable, NoFreeBlock, chain_hashes


def filled(pool: BlockPool, num_tokens: int) -> BlockTable:
    t = BlockTable()
    assert pool.reserve(t, num_tokens) is None
    t.num_tokens = num_tokens
    return t


def test_a_table_gets_one_block_per_block_size_tokens_and_frees_them():
    pool = BlockPool(8, 4)
    t = filled(pool, 9)
    assert len(t.blocks) == 3 and len(set(t.blocks)) == 3
    assert pool.num_free == 5 and pool.num_used == 3
    pool.free(t)
    assert pool.num_free == 8 and t.blocks == []


def test_reserve_raises_and_leaves_the_table_unchanged_when_the_pool_is_full():
    pool = BlockPool(3, 4)
    t = filled(pool, 8)
    other = filled(pool, 4)
    with pytest.raises(NoFreeBlock):
        pool.reserve(t, 9)
    assert len(t.blocks) == 2 and pool.num_free == 0
    pool.free(other)
    assert pool.reserve(t, 9) is None and len(t.blocks) == 3


def test_a_fork_shares_every_block_and_copies_the_shared_partial_block_on_first_write():
    pool = BlockPool(8, 4)
    parent = filled(pool, 6)                        # one full block, one with 2 of 4 tokens
    child = pool.fork(parent)
    assert child.blocks == parent.blocks and all(pool.ref[b] == 2 for b in parent.blocks)
    copy = pool.reserve(child, 7)                   # writing token 7 into the shared partial block
    assert copy == (parent.blocks[1], child.blocks[1]) and child.blocks[1] != parent.blocks[1]
    assert child.blocks[0] == parent.blocks[0] and pool.ref[parent.blocks[0]] == 2
    assert pool.ref[parent.blocks[1]] == 1 and pool.stats["cow_copies"] == 1
    # The parent is now the partial block's only holder: it writes in place.
    assert pool.reserve(parent, 7) is None


def test_a_full_shared_block_is_never_copied_a_new_block_follows_it():
    pool = BlockPool(8, 4)
    parent = filled(pool, 4)
    child = pool.fork(parent)
    assert pool.reserve(child, 5) is None
    assert child.blocks[0] == parent.blocks[0] and len(child.blocks) == 2


def test_hash_chains_name_the_whole_prefix_not_just_the_block():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert chain_hashes([1, 2, 3, 4, 5, 6], 4) == a[:1]


def test_a_table_extends_its_hash_chain_and_registers_what_a_fresh_chain_names(monkeypatch):
    """register() and lookup() extend the chain a table carries (its fork's too) instead of hashing every block
    again; what they cache and find is what chains computed from the first block name."""
    import services.rollout.engine_torch.paged.blocks as blocks

    hashed = []
    digest = blocks.hashlib.blake2b
    monkeypatch.setattr(blocks.hashlib, "blake2b", lambda *a, **k: hashed.append(1) or digest(*a, **k))
    pool, prompt, adapter = BlockPool(16, 4), list(range(1, 11)), ("a", 1, 0)
    t = pool.lookup(prompt, 0, limit=len(prompt) - 1, adapter=adapter)
    assert t.blocks == [] and len(t.hashes) == 2
    assert pool.reserve(t, len(prompt)) is None
    t.num_tokens = len(prompt)
    n = len(hashed)
    pool.register(prompt, t, 0, adapter=adapter)                     # both full blocks' hashes were known
    assert len(hashed) == n + 1                                         # the adapter's seed only
    fork = pool.fork(t)
    seq = prompt + [20, 21, 22, 23, 24, 25]
    assert pool.reserve(fork, len(seq)) is not None
    fork.num_tokens = len(seq)
    pool.register(seq, fork, 0, adapter=adapter)
    assert len(hashed) == n + 4                                         # the seed and the fork's two new blocks
    fresh = chain_hashes(seq, 4, blocks.adapter_seed(adapter))
    assert fork.hashes == fresh and set(pool._by_hash) == set(fresh)
    assert pool.lookup(seq + [1], 0, adapter=adapter).num_tokens == 16
    assert pool.lookup(seq + [1], 0).num_tokens == 0                    # the base model's chain differs
    pool.free(fork)
    assert fork.hashes == [] and fork.seed is None


def test_a_registered_prefix_is_found_by_a_later_sequence_and_shared():
    pool = BlockPool(8, 4)
    tokens = list(range(10))
    t = filled(pool, 10)
    pool.register(tokens, t, version=3)
    hit = pool.lookup(tokens[:8] + [99, 98], version=3)
    assert hit.blocks == t.blocks[:2] and hit.num_tokens == 8
    assert pool.ref[t.blocks[0]] == 2
    miss = pool.lookup([0, 1, 2, 7] + tokens[4:], version=3)
    assert miss.blocks == [] and miss.num_tokens == 0
    assert pool.stats["prefix_hit_blocks"] == 2 and pool.stats["prefix_lookup_blocks"] == 4


def test_lookup_honours_its_limit_so_the_last_token_is_always_fed():
    pool = BlockPool(8, 4)
    tokens = list(range(8))
    t = filled(pool, 8)
    pool.register(tokens, t, version=0)
    assert pool.lookup(tokens, 0, limit=7).num_tokens == 4


def test_cached_blocks_nobody_holds_survive_until_evicted_oldest_first():
    pool = BlockPool(4, 2)
    old, new = filled(pool, 2), filled(pool, 2)
    pool.register([1, 1], old, 0)
    pool.register([2, 2], new, 0)
    b_old, b_new = old.blocks[0], new.blocks[0]
    pool.free(old)
    pool.free(new)
    assert pool.num_cached == 2 and pool.num_free == 4
    taken = filled(pool, 6)                          # 2 free blocks, then the oldest cached one
    assert b_old in taken.blocks and b_new not in taken.blocks and pool.stats["evicted_blocks"] == 1
    assert pool.lookup([1, 1, 0], 0).blocks == []
    assert pool.lookup([2, 2, 0], 0).blocks == [b_new]


def test_a_hit_takes_the_block_off_the_lru_list_so_it_is_not_evicted_under_its_holder():
    pool = BlockPool(2, 2)
    t = filled(pool, 2)
    pool.register([5, 6], t, 0)
    cached = t.blocks[0]
    pool.free(t)
    held = pool.lookup([5, 6, 7], 0)
    assert held.blocks == [cached] and held.num_tokens == 2
    other = filled(pool, 2)
    assert other.blocks[0] != held.blocks[0]
    with pytest.raises(NoFreeBlock):
        pool.allocate()


def test_a_weight_change_drops_older_cached_blocks_and_a_lookup_never_returns_them():
    pool = BlockPool(4, 2)
    t = filled(pool, 4)
    pool.register([1, 2, 3, 4], t, version=1)
    assert pool.lookup([1, 2, 3, 4, 5], version=2).blocks == []     # stale on lookup: dropped
    assert pool.num_cached == 1
    held = pool.lookup([1, 2, 3, 4, 5], version=1)
    pool.free(held)
    assert pool.set_version(2) == 1 and pool.num_cached == 0
    pool.free(t)
    assert pool.num_free == 4 and pool.stats["invalidated_blocks"] == 2


def test_a_block_dropped_while_held_goes_to_the_free_list_when_released():
    pool = BlockPool(2, 2)
    t = filled(pool, 2)
    pool.register([1, 2], t, 0)
    pool.set_version(1)
    pool.free(t)
    assert pool.num_free == 2 and pool.num_cached == 0
    assert pool.lookup([1, 2, 3], 0).blocks == []


def test_registering_tokens_cached_by_another_block_keeps_this_copy_private():
    pool = BlockPool(4, 2)
    a, b = filled(pool, 2), filled(pool, 2)
    pool.register([7, 8], a, 0)
    pool.register([7, 8], b, 0)
    assert pool.num_cached == 1
    pool.free(b)
    assert pool.num_free == 3 and pool.num_cached == 1


def test_bad_pool_sizes_are_refused():
    with pytest.raises(ValueError, match="block"):
        BlockPool(0, 16)
