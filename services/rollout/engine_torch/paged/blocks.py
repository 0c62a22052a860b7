"""The paged KV cache's bookkeeping, pure Python: fixed-size blocks with reference counts, block tables that fork
copy-on-write, and a prefix cache keyed by hash chains of token blocks, with LRU eviction and weight versions.

A block holds the KV of `block_size` consecutive tokens of one sequence. A sequence's block table lists its blocks in
order; position p lives in slot table[p // block_size] * block_size + p % block_size of the pool. Forking a table
(a GRPO group's n samples of one prompt) shares every block (ref count + 1); the first write into a shared, partly
filled last block copies it first (copy on write), so the samples never see each other's tokens.

Full blocks whose KV is complete can be registered in the prefix cache under the hash chain of their tokens
(h_i = H(h_{i-1}, tokens of block i)), tagged with the weight version their KV was computed under. A later sequence
that starts with the same tokens (another call's prompt, the next turn of an episode) takes those blocks instead of
recomputing them. A cached block that no table holds stays in an LRU list until its memory is needed; when the
weights change every cached block of an older version is dropped (a block still held keeps serving its holder, but
is no longer found).

Blocks computed by a LoRA adapter's rows hold that adapter's KV: their chain starts from a seed of the adapter's
identity (name, version, load) instead of the empty one, so the same tokens under another adapter or the base model
never find them, and they are dropped when that adapter is reloaded or unloaded (keep_adapters).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field


class NoFreeBlock(Exception):
    """The pool has no free block and nothing cached to evict: the caller preempts a sequence or waits."""


@dataclass
class BlockTable:
    """One sequence's blocks in order and how many of its tokens have their KV in them. hashes: the hash chain (from
    `seed`) of the sequence's first full blocks of tokens as far as it was computed; a table's sequence only grows
    (a fork's is its source's, an episode's next turn extends the pinned one), so the pool extends the chain rather
    than hashing every block again when the sequence is registered (a GRPO row's 64 prompt blocks, 512 rows)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)
    seed: bytes | None = None


# What a block's KV was computed with besides the base weights: a LoRA adapter's (name, version, load), or None.
Adapter = tuple[str, int, int] | None


def adapter_seed(adapter: Adapter) -> bytes:
    """The first parent of a hash chain: empty for the base model, a digest of the adapter's identity otherwise."""
    if adapter is None:
        return b""
    name, version, load = adapter
    return hashlib.blake2b(f"lora\0{name}\0{version}\0{load}".encode(), digest_size=16).digest()


def chain_hashes(tokens: list[int], block_size: int, seed: bytes = b"", known: list[bytes] = ()) -> list[bytes]:
    """The hash chain of the full blocks of `tokens`: entry i names blocks 0..i (16-byte blake2b digests), starting
    from `seed` (adapter_seed); `known`: the chain's first entries, already computed for these tokens."""
    full = len(tokens) // block_size
    out = list(known[:full])
    parent = out[-1] if out else seed
    for i in range(len(out), full):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(struct.pack(f"<{block_size}q", *tokens[i * block_size:(i + 1) * block_size]))
        parent = h.digest()
        out.append(parent)
    return out


class BlockPool:
    """Allocator, reference counts and prefix cache over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs >= 1 block of >= 1 token (got {num_blocks} x {block_size})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))      # hold nothing worth keeping
        self._lru: OrderedDict[int, None] = OrderedDict()      # cached, held by no table: evictable, oldest first
        self._hash_of: dict[int, bytes] = {}                   # cached block -> its chain hash
        self._by_hash: dict[bytes, int] = {}
        self._version: dict[int, int] = {}                     # cached block -> weight version of its KV
        self._adapter: dict[int, tuple] = {}                   # cached block -> the adapter its KV is of, if any
        self.stats = {"prefix_lookup_blocks": 0, "prefix_hit_blocks": 0, "evicted_blocks": 0,
                      "invalidated_blocks": 0, "cow_copies": 0}

    # ---- allocation

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones and evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_unused(self) -> int:
        """Blocks an allocation can take without evicting a cached one."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def allocate(self) -> int:
        """A block held once by the caller: a free one, else the least recently used cached one (evicted)."""
        if self._free:
            b = self._free.popleft()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)
            self._uncache(b)
            self.stats["evicted_blocks"] += 1
        else:
            raise NoFreeBlock
        self.ref[b] = 1
        return b

    def hold(self, b: int) -> None:
        """One more holder of block b (a fork, or a prefix-cache hit)."""
        if self.ref[b] == 0:
            self._lru.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """One holder fewer; a block nobody holds goes to the LRU list when cached, else back to the free list."""
        assert self.ref[b] > 0, f"block {b} released more often than held"
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self._hash_of:
                self._lru[b] = None
            else:
                self._free.append(b)

    # ---- tables

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table sharing every block of `table` (copy on write at its first write into a shared block)."""
        for b in table.blocks:
            self.hold(b)
        return BlockTable(list(table.blocks), table.num_tokens, table.hashes, table.seed)

    def free(self, table: BlockTable) -> None:
        for b in table.blocks:
            self.release(b)
        table.blocks, table.num_tokens, table.hashes, table.seed = [], 0, [], None

    def reserve(self, table: BlockTable, num_tokens: int) -> tuple[int, int] | None:
        """Makes room in `table` for its tokens up to `num_tokens`: new blocks as needed, and a private copy of a
        shared, partly filled last block before it is written. Returns (source, copy) when the caller must copy
        that block's KV, else None. Raises NoFreeBlock with the table unchanged when the pool is full."""
        bs = self.block_size
        need = -(-num_tokens // bs) - len(table.blocks)
        copy = None
        last_shared = table.num_tokens % bs != 0 and self.ref[table.blocks[-1]] > 1
        if need + last_shared > self.num_free:
            raise NoFreeBlock
        if last_shared:
            src = table.blocks[-1]
            dst = self.allocate()
            self.release(src)
            table.blocks[-1] = dst
            copy = (src, dst)
            self.stats["cow_copies"] += 1
        table.blocks.extend(self.allocate() for _ in range(need))
        return copy

    # ---- prefix cache

    def lookup(self, tokens: list[int], version: int, *, limit: int | None = None,
               adapter: Adapter = None) -> BlockTable:
        """A table holding the cached blocks of the longest cached prefix of `tokens` (full blocks, at most
        `limit` tokens) computed under weight `version` (and `adapter`); its num_tokens says how many tokens they
        cover."""
        bs = self.block_size
        table = BlockTable()
        hashes = self._chain(table, tokens[:limit] if limit is not None else tokens, adapter)
        self.stats["prefix_lookup_blocks"] += len(hashes)
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            if self._version[b] != version:
                self._drop(b)
                break
            self.hold(b)
            table.blocks.append(b)
        table.num_tokens = len(table.blocks) * bs
        self.stats["prefix_hit_blocks"] += len(table.blocks)
        return table

    def register(self, tokens: list[int], table: BlockTable, version: int, *, adapter: Adapter = None) -> None:
        """Caches the full blocks of `table` whose KV holds `tokens` (computed under weight `version`, by
        `adapter`'s rows); a block whose tokens are cached already (another copy) stays private."""
        hashes = self._chain(table, tokens[:table.num_tokens], adapter)
        for h, b in zip(hashes, table.blocks):
            if b in self._hash_of or h in self._by_hash:
                continue
            self._hash_of[b], self._by_hash[h], self._version[b] = h, b, version
            if adapter is not None:
                self._adapter[b] = adapter

    def _chain(self, table: BlockTable, tokens: list[int], adapter: Adapter) -> list[bytes]:
        """The hash chain of `tokens` (table's sequence, or a prefix of it), extending the one table holds."""
        seed = adapter_seed(adapter)
        if table.seed != seed:
            table.hashes, table.seed = [], seed
        full = len(tokens) // self.block_size
        if len(table.hashes) < full:
            table.hashes = chain_hashes(tokens, self.block_size, seed, table.hashes)
        return table.hashes[:full]

    def set_version(self, version: int) -> int:
        """The weights are now `version`: drops every cached block computed under another one; how many."""
        stale = [b for b, v in self._version.items() if v != version]
        for b in stale:
            self._drop(b)
        return len(stale)

    def keep_adapters(self, served: set) -> int:
        """Adapters were (re)loaded or unloaded: drops every cached block of an adapter identity not in `served`
        (the base model's blocks and the served adapters' stay); how many."""
        stale = [b for b, a in self._adapter.items() if a not in served]
        for b in stale:
            self._drop(b)
        return len(stale)

    def _drop(self, b: int) -> None:
        """Takes block b out of the prefix cache (a stale version); freed when nobody holds it."""
        self._uncache(b)
        self.stats["invalidated_blocks"] += 1
        if b in self._lru:
            del self._lru[b]
            self._free.append(b)

    def _uncache(self, b: int) -> None:
        h = self._hash_of.pop(b)
        del self._by_hash[h]
        del self._version[b]
        self._adapter.pop(b, None)

    def metrics(self) -> dict:
        looked, hit = self.stats["prefix_lookup_blocks"], self.stats["prefix_hit_blocks"]
        return {"kv_blocks_total": self.num_blocks, "kv_blocks_used": self.num_used, "kv_blocks_free": self.num_free,
                "kv_blocks_cached": self.num_cached, "prefix_cache_hit_rate": round(hit / looked, 4) if looked else 0.0,
                **self.stats}
