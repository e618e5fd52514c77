"""The KV cache as a pool of fixed-size blocks: allocation, sharing and prefix caching.

Only bookkeeping lives here (block ids, reference counts, hashes); the tensors are in
:mod:`llmctl.serve.model.kv_cache` and the policy of who gets blocks in
:mod:`llmctl.serve.core.scheduler`.

- Each sequence owns a block table: token ``i`` lives in slot ``i % block_size`` of
  block ``block_table[i // block_size]``.
- A block can be shared (reference count > 1): by the ``n`` completions of one prompt
  (:meth:`BlockManager.fork`) and by requests that share a prefix. A shared block that
  must be written is copied first (copy-on-write; only a fork's partial last block can
  be in that state).
- Prefix caching: once a block is full and computed it is registered under a chained
  hash, ``h_i = blake2b(h_{i-1} || token_ids_i)``, so a block's key names its whole
  prefix; ``h_{-1}`` is empty, or a LoRA adapter's salt for a request that runs one
  (:func:`chain_root`). A lookup is confirmed by comparing the block's own token ids and
  its parent's hash (vLLM moved to a cryptographic hash for the same reason: a server
  must not let one client's crafted prompt collide with another's cached prefix).
- Freed blocks keep their contents and stay findable until their memory is needed:
  the free pool is an LRU list; blocks without a hash go to its front (reused first),
  registered ones to its back, the tail of a sequence before its head (a prompt's
  later blocks are less likely to be shared than its first ones).

Sliding windows (``sliding_window=W``: the largest window, when every layer has one;
vLLM's V1 sliding-window manager works the same way). The query at position ``p`` reads
keys ``p - W + 1 .. p`` only, and a sequence's next query is at ``num_computed_tokens``
(``c``), so block ``i`` is never read again once ``(i + 1) * block_size <= c - W + 1``.
Before giving a sequence new slots, :meth:`BlockManager.allocate` releases such blocks
and marks their table entries :data:`DROPPED`: a sequence holds at most the blocks its
window and this step's tokens span: positions ``c - W + 1 .. c + n - 1`` for ``n`` new
tokens, at most ``ceil((W + n - 2) / block_size) + 1`` blocks (2 for a decode with
``W <= block_size + 1``), however long it grows. (Release happens when a sequence is
next scheduled: after a prompt step it still holds the prompt's blocks.)

A cached prefix of ``k`` blocks is then valid when the blocks its next token's window
reaches into are still held: the last ``ceil((W - 1) / block_size)`` of them (the keys
``k * block_size - W + 1 .. k * block_size - 1``); the blocks before may have been
evicted and are taken as :data:`DROPPED`. :meth:`BlockManager.find_cached_prefix`
scans from the right for the longest such run, or takes a shorter run that starts at
block 0 (vLLM's ``SlidingWindowManager.find_longest_cache_hit``). A block's hash still
chains every token before it, so a hit names the whole prefix even when its first
blocks are gone; a sequence carries the hash of its last registered block
(``chain_hash``), because that block may be dropped before the next one is full.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from llmctl.serve.core.sequence import Sequence

# A block table entry whose block was released: out of every layer's sliding window.
DROPPED = -1


def block_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + array.array("q", token_ids).tobytes(),
                           digest_size=16).digest()


def chain_root(seq: Sequence) -> bytes:
    """The parent of a sequence's first block: empty for the base model, the adapter's
    salt for a LoRA request (the same tokens under another adapter have other K/V, so
    they must never share blocks; vLLM adds its ``lora_int_id`` to the block hash)."""
    lora = seq.request.lora
    return b"" if lora is None else lora.cache_salt


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        # blocks a cached prefix must hold at its end (see the module docstring); at least
        # one, so a hit always has a live last block
        self.window_blocks = max(1, -(-(sliding_window - 1) // block_size)) \
            if sliding_window else 0
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

    def held_blocks(self, seq: Sequence) -> list[int]:
        """The blocks ``seq`` holds (its table without dropped entries)."""
        return [b for b in seq.block_table if b != DROPPED]

    def exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks that return to the pool when ``seq`` is freed (shared ones stay)."""
        return sum(1 for b in seq.block_table if b != DROPPED and self.blocks[b].ref_count == 1)

    def revivals(self, cached: Iterable[int]) -> int:
        """Blocks of a cached prefix that taking it moves out of the free pool."""
        return sum(1 for b in cached if b != DROPPED and self.blocks[b].ref_count == 0)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``'s tokens (with sliding
        windows, :data:`DROPPED` for leading blocks no window reaches).

        At most ``num_tokens - 1`` tokens can come from the cache: the last one must be
        computed to get the logits that sample the next token.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        bs = self.block_size
        tokens = seq.token_ids
        chunks = [tuple(tokens[i * bs:(i + 1) * bs]) for i in range((len(tokens) - 1) // bs)]
        if self.sliding_window is not None:
            return self._windowed_prefix(chunks, chain_root(seq))
        hits: list[int] = []
        parent = chain_root(seq)
        for chunk in chunks:
            h = block_hash(parent, chunk)
            block_id = self._lookup(h, parent, chunk)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def _windowed_prefix(self, chunks: list[tuple[int, ...]], root: bytes) -> list[int]:
        """The longest prefix whose last ``window_blocks`` blocks are cached, or a shorter
        one cached from block 0 (see the module docstring)."""
        parents, parent = [], root
        for chunk in chunks:
            parents.append(parent)
            parent = block_hash(parent, chunk)
        hashes = parents[1:] + [parent]
        hits = [DROPPED] * len(chunks)
        run = 0
        for i in range(len(chunks) - 1, -1, -1):
            block_id = self._lookup(hashes[i], parents[i], chunks[i])
            if block_id is None:
                run = 0
                continue
            hits[i] = block_id
            run += 1
            if run >= self.window_blocks:
                return hits[:i + run]
        return hits[:run]

    def _lookup(self, h: bytes, parent: bytes, chunk: tuple[int, ...]) -> int | None:
        """The cached block registered under ``h``, confirmed by its tokens and parent."""
        block_id = self.cached.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != chunk or block.parent_hash != parent:
            return None
        return block_id

    def _out_of_window(self, table: list[int], computed: int) -> list[int]:
        """Indices of held entries of ``table`` that no query from position ``computed``
        on reads: blocks ending at or before ``computed - W + 1``."""
        if self.sliding_window is None:
            return []
        end = min(len(table), (computed - self.sliding_window + 1) // self.block_size)
        out = []
        for i in range(end - 1, -1, -1):
            if table[i] == DROPPED:
                break  # dropped from the front: everything before is dropped too
            out.append(i)
        return out

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int,
                 cached: Iterable[int] = ()) -> list[tuple[int, int]] | None:
        """Give ``seq`` slots for its next ``num_new_tokens`` tokens.

        ``cached`` (from :meth:`find_cached_prefix`, only for a sequence without blocks)
        is taken as its computed prefix. With a sliding window, blocks out of it are
        released first (their slots are free for this very call). Returns the (src, dst)
        block copies to run before the step (copy-on-write), or None, changing nothing,
        when the pool is too small.
        """
        cached = list(cached)
        bs = self.block_size
        table = seq.block_table
        if cached and table:
            raise RuntimeError("a cached prefix is only taken by a sequence without blocks")
        computed = len(cached) * bs if cached else seq.num_computed_tokens
        have = len(cached) if cached else len(table)
        need = max(0, self.blocks_needed(computed + num_new_tokens) - have)
        chain = b""
        if cached:
            chain = self.blocks[cached[-1]].hash  # a hit's last block is held, registered
            for i in self._out_of_window(cached, computed):
                cached[i] = DROPPED  # not taken at all
        cow = False
        if num_new_tokens and computed % bs and computed // bs < have:
            partial = cached[computed // bs] if cached else table[computed // bs]
            cow = self.blocks[partial].ref_count > 1
        dropping = self._out_of_window(table, computed)
        released = sum(1 for i in dropping if self.blocks[table[i]].ref_count == 1)
        if need + cow > len(self.free) - self.revivals(cached) + released:
            return None

        for i in dropping:
            self._release(table[i])
            table[i] = DROPPED
        if cached or not table:
            self.stats.queried_tokens += seq.num_tokens
        if cached:
            for block_id in cached:
                if block_id == DROPPED:
                    continue
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
            table.extend(cached)
            seq.num_computed_tokens = computed
            seq.num_cached_tokens = computed
            seq.num_hashed_blocks = len(cached)
            seq.chain_hash = chain
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

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unshared block returns to the pool (still cached)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            self.free[block_id] = None  # most recently used end
        else:
            block.hash, block.token_ids, block.parent_hash = None, (), b""
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; unshared blocks return to the pool (still cached)."""
        for block_id in reversed(seq.block_table):
            if block_id != DROPPED:
                self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.chain_hash = b""

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release blocks beyond the first ``num_tokens`` slots (rejected draft tokens)."""
        keep = self.blocks_needed(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            block_id = table.pop()
            if block_id == DROPPED:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.hash, block.token_ids, block.parent_hash = None, (), b""
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (its prompt and first token)."""
        for block_id in parent.block_table:
            if block_id != DROPPED:
                self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.chain_hash = parent.chain_hash
        child.num_cached_tokens = parent.num_cached_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        tokens = seq.token_ids
        table = seq.block_table
        parent = seq.chain_hash if seq.num_hashed_blocks else chain_root(seq)
        for i in range(seq.num_hashed_blocks, full):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            if table[i] != DROPPED:  # (a block is registered before its window passes it)
                block = self.blocks[table[i]]
                block.hash, block.parent_hash, block.token_ids = h, parent, chunk
                # the same prefix computed twice (two requests in one step): keep the first
                self.cached.setdefault(h, table[i])
            parent = h
        if full > seq.num_hashed_blocks:
            seq.num_hashed_blocks = full
            seq.chain_hash = parent

    # --- checks ------------------------------------------------------------------------------
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError if the books do not balance (used by tests)."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in self.held_blocks(seq):
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
