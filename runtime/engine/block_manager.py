"""The KV-cache block pool: reference counts, a free list, block tables, and the prefix cache.

A full block is identified by the hash of its tokens chained with the previous block's hash
(seeded with the model's identity), so equal prefixes map to equal hashes. The hash is sha256 of
the parent's digest and the token ids packed as int64 (``block_key``): Python's ``hash()`` of a
tuple is 64 bits and not collision resistant, so a crafted prompt could collide with another
user's cached prefix and be served its KV (vLLM's CVE-2025-25183); a sha256 chain cannot be
steered that way, and gives the same keys in every process whatever PYTHONHASHSEED is. It costs
about 1-2 us a block. A freed block keeps its hash and contents and joins the back of the free
list; taking a block from the front of the list evicts the least recently freed one. A new
sequence reuses every cached leading block. Prompt blocks still being computed are known by hash
too ("in flight"), so a request that arrives with the same prefix can wait a step for them
instead of computing them again.

With a sliding window on every layer (``window``), a block whose tokens have all left the window of the
sequence's next position is given back at once (``slide``): its entry in the block table becomes
``GIVEN_BACK`` and the attention kernels never read it, so a long conversation holds about window /
block_size blocks however long it grows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence

BLOCK_SIZE = 16  # tokens a KV-cache block holds unless the engine's config says otherwise

GIVEN_BACK = -1  # a block table entry whose block a sliding window gave back (never read again)


def root_key(model_id: str) -> bytes:
    """The chain's seed: different models never share a key."""
    return hashlib.sha256(b"infer-prefix\0" + model_id.encode()).digest()


def block_key(parent: bytes, tokens) -> bytes:
    """sha256 of the parent block's key (32 bytes) then this block's token ids as int64."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, model_id: str = "",
                 window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.block_size = block_size
        self.window = window  # every layer's sliding window, or None: blocks stay until the sequence ends
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU order
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.in_flight: dict[bytes, int] = {}  # hash of a prompt block being computed -> the computing seq_id
        self.root_hash = root_key(model_id)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found

    # ------------------------------------------------------------------ accounting
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    # ------------------------------------------------------------------ prefix cache
    def _chain(self, prev: bytes, tokens: list[int]) -> bytes:
        return block_key(prev, tokens)

    def match_prefix(self, seq: Sequence) -> int | None:
        """Attaches cached leading blocks to a sequence that has none yet; returns tokens reused.

        Returns None, attaching and counting nothing, when the first block the sequence would
        compute is being computed by another sequence right now: it should wait for it instead.
        At least the last token is always left to compute: its logits are needed to sample.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        found, h = [], self.root_hash
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            h = self._chain(h, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                if self.in_flight.get(h, seq.seq_id) != seq.seq_id:
                    return None
                break
            found.append(block_id)
        self.prefix_queries += len(seq) - 1
        for block_id in found:
            self._take(block_id)
        seq.block_table.extend(found)
        hit = len(found) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = hit
        seq.num_hashed_blocks = len(found)
        self.prefix_hits += hit
        return hit

    def _hashed_tip(self, seq: Sequence) -> bytes:
        """The chain hash of the sequence's last registered block (the root before any)."""
        return self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else self.root_hash

    def mark_in_flight(self, seq: Sequence) -> None:
        """Notes the full prompt blocks a newly scheduled sequence is about to compute."""
        if not self.enable_prefix_caching or seq.in_flight_hashes:
            return
        h = self._hashed_tip(seq)
        for i in range(seq.num_hashed_blocks, seq.num_prompt_tokens // self.block_size):
            h = self._chain(h, seq.block_tokens(i, self.block_size))
            if self.in_flight.setdefault(h, seq.seq_id) == seq.seq_id:
                seq.in_flight_hashes.append(h)

    def _land(self, seq: Sequence, h: bytes) -> None:
        """Nobody needs to wait for block hash ``h`` from this sequence any more."""
        if self.in_flight.get(h) == seq.seq_id:
            del self.in_flight[h]

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes blocks whose K/V are now complete so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        h = self._hashed_tip(seq)
        for i in range(seq.num_hashed_blocks, full):
            tokens = seq.block_tokens(i, self.block_size)
            h = self._chain(h, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tuple(tokens)
            self.cached.setdefault(h, block.block_id)
            self._land(seq, h)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # ------------------------------------------------------------------ allocation
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _new_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached contents
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows the sequence's block table to hold ``num_new_tokens`` more tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {needed}, {len(self.free)} free")
        seq.block_table.extend(self._new_block() for _ in range(needed))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Shares the parent's full blocks with a child (copy-on-write is never needed: full blocks are immutable)."""
        shared = parent.num_computed_tokens // self.block_size
        for block_id in parent.block_table[:shared]:
            if block_id != GIVEN_BACK:
                self._take(block_id)
        child.block_table = parent.block_table[:shared]
        child.num_computed_tokens = shared * self.block_size
        child.num_hashed_blocks = min(parent.num_hashed_blocks, shared)
        child.num_slid_blocks = min(parent.num_slid_blocks, shared)

    def trim(self, seq: Sequence) -> None:
        """Gives back blocks past what the sequence's tokens need (rejected speculative tokens had them).
        They hold no verified token, so they were never hashed."""
        keep = -(-len(seq) // self.block_size)
        for block_id in seq.block_table[keep:]:
            self._release(block_id)
        del seq.block_table[keep:]

    def slide(self, seq: Sequence) -> None:
        """Gives back the blocks wholly before the sliding window of the sequence's next position (its
        K/V stay cached by hash like any freed block's). The last hashed block stays: the prefix cache
        chains the next block's hash from it."""
        if self.window is None:
            return
        first_visible = seq.num_computed_tokens - self.window + 1  # the next query's window starts here
        end = first_visible // self.block_size
        if self.enable_prefix_caching:
            end = min(end, seq.num_hashed_blocks - 1)
        for i in range(seq.num_slid_blocks, max(end, 0)):
            self._release(seq.block_table[i])
            seq.block_table[i] = GIVEN_BACK
        seq.num_slid_blocks = max(seq.num_slid_blocks, end)

    def _release(self, block_id: int) -> None:
        """Drops one reference; a block nobody holds goes to the free list: at the back (evicted last)
        when its contents are in the prefix cache, at the front (used first) when they are not."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None or self.cached.get(block.hash) != block_id:
                block.hash, block.token_ids = None, ()
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)  # no reusable content: use first
            else:
                self.free[block_id] = None

    def free_sequence(self, seq: Sequence) -> None:
        """Returns a sequence's blocks; the newest go to the back of the free list, last to be evicted."""
        for block_id in reversed(seq.block_table):
            if block_id != GIVEN_BACK:
                self._release(block_id)
        seq.block_table = []
        seq.num_slid_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        for h in seq.in_flight_hashes:  # computed or abandoned: nobody waits on them any more
            self._land(seq, h)
        seq.in_flight_hashes = []
