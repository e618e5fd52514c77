"""The KV cache as a pool of fixed-size blocks: allocation, sharing and prefix caching.

Only bookkeeping lives here (block ids, reference counts, hashes); the tensors are in
:mod:`llmctl.serve.kv_cache` and the policy of who gets blocks in
:mod:`llmctl.serve.scheduler`.

- Each sequence owns a block table: token ``i`` lives in slot ``i % block_size`` of
  block ``block_table[i // block_size]``.
- A block can be shared (reference count > 1): by the ``n`` completions of one prompt
  (:meth:`BlockManager.fork`) and by requests that share a prefix. A shared block that
  must be written is copied first (copy-on-write; only a fork's partial last block can
  be in that state).
- Prefix caching: once a block is full and computed it is registered under a chained
  hash, ``h_i = blake2b(h_{i-1} || token_ids_i)``, so a block's key names its whole
  prefix. A lookup is confirmed by comparing the block's own token ids and its parent's
  hash (vLLM moved to a cryptographic hash for the same reason: a server must not let
  one client's crafted prompt collide with another's cached prefix).
- Freed blocks keep their contents and stay findable until their memory is needed:
  the free pool is an LRU list; blocks without a hash go to its front (reused first),
  registered ones to its back, the tail of a sequence before its head (a prompt's
  later blocks are less likely to be shared than its first ones).
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from llmctl.serve.sequence import Sequence


def block_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + array.array("q", token_ids).tobytes(),
                           digest_size=16).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.parent_hash: bytes = b""
        self.token_ids: tuple[int, ...] = ()


@dataclass
class CacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.stats = CacheStats()

    # --- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence (cached-but-free ones included)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``'s tokens.

        At most ``num_tokens - 1`` tokens can come from the cache: the last one must be
        computed to get the logits that sample the next token.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        bs = self.block_size
        tokens = seq.token_ids
        hits: list[int] = []
        parent = b""
        for start in range(0, (len(tokens) - 1) // bs * bs, bs):
            chunk = tuple(tokens[start:start + bs])
            h = block_hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent:
                break
            hits.append(block_id)
            parent = h
        return hits

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int,
                 cached: Iterable[int] = ()) -> list[tuple[int, int]] | None:
        """Give ``seq`` slots for its next ``num_new_tokens`` tokens.

        ``cached`` (from :meth:`find_cached_prefix`, only for a sequence without blocks)
        is taken as its computed prefix. Returns the (src, dst) block copies to run
        before the step (copy-on-write), or None, changing nothing, when the pool is
        too small.
        """
        cached = list(cached)
        bs = self.block_size
        table = seq.block_table
        if cached and table:
            raise RuntimeError("a cached prefix is only taken by a sequence without blocks")
        computed = len(cached) * bs if cached else seq.num_computed_tokens
        have = len(cached) if cached else len(table)
        need = max(0, self.blocks_needed(computed + num_new_tokens) - have)
        cow = False
        if num_new_tokens and computed % bs and computed // bs < have:
            partial = cached[computed // bs] if cached else table[computed // bs]
            cow = self.blocks[partial].ref_count > 1
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if need + cow > len(self.free) - revived:
            return None

        if cached or not table:
            self.stats.queried_tokens += seq.num_tokens
        if cached:
            for block_id in cached:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
            table.extend(cached)
            seq.num_computed_tokens = computed
            seq.num_cached_tokens = computed
            seq.num_hashed_blocks = len(cached)
            self.stats.hit_tokens += computed
        copies: list[tuple[int, int]] = []
        if cow:
            index = computed // bs
            src = table[index]
            dst = self._take_free()
            self.blocks[src].ref_count -= 1
            table[index] = dst
            copies.append((src, dst))
        for _ in range(need):
            table.append(self._take_free())
        return copies

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            # evict: the least recently freed cached block gives up its contents
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.parent_hash = None, (), b""
        block.ref_count = 1
        return block_id

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; unshared blocks return to the pool (still cached)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                self.free[block_id] = None  # most recently used end
            else:
                block.hash, block.token_ids, block.parent_hash = None, (), b""
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release blocks beyond the first ``num_tokens`` slots (rejected draft tokens)."""
        keep = self.blocks_needed(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            block_id = table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.hash, block.token_ids, block.parent_hash = None, (), b""
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (its prompt and first token)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.num_cached_tokens = parent.num_cached_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        tokens = seq.token_ids
        table = seq.block_table
        for i in range(seq.num_hashed_blocks, full):
            parent = (self.blocks[table[i - 1]].hash or b"") if i else b""
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            block = self.blocks[table[i]]
            block.hash, block.parent_hash, block.token_ids = h, parent, chunk
            # the same prefix computed twice (two requests in one step): keep the first
            self.cached.setdefault(h, table[i])
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # --- checks ------------------------------------------------------------------------------
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError if the books do not balance (used by tests)."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count}, "
                                     f"owned {refs[block.block_id]} times")
            in_free = block.block_id in self.free
            if in_free != (block.ref_count == 0):
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} "
                                     f"but in_free={in_free}")
        for h, block_id in self.cached.items():
            if self.blocks[block_id].hash != h:
                raise AssertionError(f"cache entry for block {block_id} has a stale hash")
