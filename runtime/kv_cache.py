"""Paged KV cache bookkeeping: which block belongs to which request (docs/contracts.md, "KV cache").

The compiled module owns the storage, `[2, num_blocks, block_size, n_kv_heads, head_dim]` per layer; this
module alone owns the assignment of blocks to requests (one source of truth: nothing else allocates).

- `BlockPool`: the blocks, their reference counts, a free queue (least recently freed first), checked frees,
  and the prefix cache: full computed blocks by chain hash, kept while free until evicted (LRU).
- `KVCacheManager`: per-request block tables on top of the pool, sliding-window release, prefix lookup
  (`get_computed_blocks`) and caching of computed blocks (`cache_blocks`). Running out of blocks is a return
  value (`allocate_slots` -> False); misuse (double free, unknown request) raises ValueError.
- Sizing: `kv_bytes_per_block`, `blocks_for_memory`, `kv_cache_budget_bytes` (--kv-cache-memory or a
  fraction of available memory).
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from llmc.dtypes import kv_block_bytes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_id(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Cache slot of one token: block_table[pos // block_size] * block_size + pos % block_size. With slot_ids
    (its array form), the one place the slot formula lives."""
    return int(block_table[position // block_size]) * block_size + position % block_size


def slot_ids(block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each token, as slot_id: block_tables[seq, pos // block_size] * block_size + pos % block_size.

    block_tables: int [B, max_blocks]; seq_index, positions: int [T]. Returns int64 [T] (the ABI's
    slot_mapping).
    """
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    return blocks * block_size + (positions % block_size)


class BlockPool:
    """The blocks, their reference counts, their free queue and the prefix cache (hash -> block).

    A block is in use (ref count >= 1: held by that many requests) or free (ref count 0, in the free queue),
    never both: `free` checks it. Allocation pops from the front of the free queue; a block whose last holder
    lets it go is appended to the back, so the queue runs from least to most recently freed.

    Prefix cache: a full block whose k/v are computed may be given its chain hash (`cache`). It keeps the hash
    while it is free, so a later request with the same tokens can take it back out of the free queue
    (`touch`); only when `allocate` hands it out again is the hash dropped: free cached blocks are evicted
    least recently freed first.
    NOTE (checked frees): a block freed once too often would sit twice in the free queue and later be handed
    to two requests, which then overwrite each other's k/v silently (vLLM issue #42571). The reference counts
    make that an immediate error instead.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # an ordered set
        self._ref_count = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # chain hash -> the block that holds those tokens' k/v
        self.num_evictions = 0  # cached blocks handed out again, since creation: for stats and tests

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to allocate) first. For tests and debugging."""
        return list(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks from the front of the free queue, each with ref count 1; cached ones are evicted."""
        assert 0 <= n <= len(self._free), f"allocate({n}) with {len(self._free)} free blocks"
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            if (h := self._hash[b]) is not None:
                del self._cached[h]
                self._hash[b] = None
                self.num_evictions += 1
            self._ref_count[b] = 1
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """One more holder for each cached block (a prefix-cache hit); a free one leaves the free queue."""
        for b in block_ids:
            assert self._hash[b] is not None, f"touch: block {b} is not cached"
            if self._ref_count[b] == 0:
                del self._free[b]
            self._ref_count[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """One holder fewer for each block; blocks nobody holds go to the back of the free queue, in order."""
        for b in block_ids:  # check everything before changing anything
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"free: block {b} is not in the pool (0..{self.num_blocks - 1})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"free: the same block appears twice in {block_ids}")
        for b in block_ids:
            if self._ref_count[b] == 0:
                raise ValueError(f"free: block {b} is already free (double free)")
        for b in block_ids:
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free[b] = None

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Record that `block_id` holds the k/v of the full block `block_hash`, unless either is cached already
        (two requests that computed the same tokens side by side: the first block stays the cached one)."""
        assert self._ref_count[block_id] > 0, f"cache: block {block_id} is free"
        if self._hash[block_id] is None and block_hash not in self._cached:
            self._hash[block_id] = block_hash
            self._cached[block_hash] = block_id


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The chain hash of a full block: sha256 over its parent's hash (b"" for the first block) and its token ids,
    so equal hashes mean equal token prefixes, hence equal k/v."""
    return hashlib.sha256(parent_hash + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


_RELEASED = -1  # a block-table entry whose block slid out of the attention window and went back to the pool


class KVCacheManager:
    """Per-request block tables over a `BlockPool` of `num_blocks` blocks of `block_size` tokens.

    A request that has called `allocate_slots` at least once owns a (possibly empty) block table until
    `free(req_id)`. `num_slots(req_id)` counts the token slots handed out so far; they are contiguous
    positions 0..num_slots-1, and the block table always has exactly cdiv(num_slots, block_size) entries.

    sliding_window W > 0 (every layer attends to the last W positions only): a query at position p never
    reads keys before p - W + 1, so `allocate_slots` first releases the blocks that lie wholly before the
    window of the chunk it allocates for. Their table entries read 0 in `block_ids`; no kernel reads them.

    enable_prefix_caching: `cache_blocks` names each computed full block by its chain hash, and
    `get_computed_blocks` finds the longest run of cached blocks that starts a token sequence, which a new
    request then shares (`allocate_slots(..., computed_blocks)`) instead of computing. A shared block is
    full, so nobody writes to it again: requests only write at positions past their computed tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int = 0, enable_prefix_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}
        self._block_hashes: dict[str, list[bytes]] = {}  # the chain hashes of each request's computed full blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one request could ever hold: the whole cache."""
        return self.pool.num_blocks * self.block_size

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._blocks

    def get_computed_blocks(self, token_ids: Sequence[int], salt: bytes = b"") -> list[int]:
        """The cached blocks holding the longest run of full blocks that starts `token_ids` ([] if caching is off).

        Never all of the tokens: the last one is left out, so a request always computes at least one token and
        its step yields logits. Changes nothing; `allocate_slots` takes the blocks. salt: what else the k/v depend
        on (LongRoPE's long set: Scheduler), the chain's first parent, as `cache_blocks` was given it.
        """
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        parent = salt
        for start in range(0, (len(token_ids) - 1) // self.block_size * self.block_size, self.block_size):
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            block = self.pool.cached_block(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(self, req_id: str, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Give `req_id` cache slots for `num_new_tokens` more tokens; False (and no change) if out of blocks.

        ```
        |<------------ num_slots (already held) ------------>|<--- num_new_tokens --->|
        | block 0 | block 1 | ... | last block: used | spare  | new block | new block  |
                                                    ^ filled first, then new blocks from the free queue
        ```
        A new request (first call) gets an empty table first, or, with `computed_blocks` (from
        `get_computed_blocks`), a table of those shared blocks whose slots count as held already.
        num_new_tokens == 0 is allowed. With a sliding window, blocks the new tokens' window has left are
        released first, even when the call returns False (except a new request's: then nothing changes).
        """
        assert num_new_tokens >= 0, f"allocate_slots({req_id!r}, {num_new_tokens})"
        assert not computed_blocks or req_id not in self._blocks, f"{req_id!r} already holds blocks"
        if req_id in self._blocks:
            blocks, num_slots = self._blocks[req_id], self._num_slots[req_id]
            if self.sliding_window:
                self._release_before(blocks, num_slots - self.sliding_window + 1)
        else:
            num_slots = len(computed_blocks) * self.block_size
            # a cached block already behind the window is not needed: it is never held, as if released
            num_behind = self._num_behind_window(num_slots, len(computed_blocks))
            blocks = [_RELEASED] * num_behind + list(computed_blocks[num_behind:])
        need = self.num_blocks_needed(num_slots + num_new_tokens) - len(blocks)
        if req_id not in self._blocks:
            revived = sum(1 for b in blocks if b != _RELEASED and self.pool.ref_count(b) == 0)
            if max(need, 0) + revived > self.pool.num_free_blocks:
                return False
            self.pool.touch([b for b in blocks if b != _RELEASED])
            self._blocks[req_id] = blocks
            self._block_hashes[req_id] = []
        elif need > self.pool.num_free_blocks:
            return False
        blocks.extend(self.pool.allocate(max(need, 0)))
        self._num_slots[req_id] = num_slots + num_new_tokens
        return True

    def _num_behind_window(self, position: int, num_blocks: int) -> int:
        """How many of the first `num_blocks` blocks hold only positions a query at `position` cannot see."""
        if not self.sliding_window:
            return 0
        return min(max(position - self.sliding_window + 1, 0) // self.block_size, num_blocks)

    def _release_before(self, blocks: list[int], position: int) -> None:
        """Let go of the blocks that hold only positions < `position` (cached ones stay cached while free)."""
        for i in range(min(max(position, 0) // self.block_size, len(blocks))):
            if blocks[i] != _RELEASED:
                self.pool.free([blocks[i]])
                blocks[i] = _RELEASED

    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int, salt: bytes = b"") -> None:
        """The request's k/v are computed for token_ids[:num_computed_tokens]: cache its full blocks among them.

        Call it only once a step has written those k/v (a failed step's blocks must never be found by others).
        """
        blocks = self._require(req_id)
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes[req_id]
        bs = self.block_size
        for i in range(len(hashes), num_computed_tokens // bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else salt, token_ids[i * bs : (i + 1) * bs]))
            if blocks[i] != _RELEASED:
                self.pool.cache(blocks[i], hashes[-1])

    def trim_slots(self, req_id: str, num_tokens: int) -> None:
        """Give back the slots past the request's first `num_tokens` (a verify step's rejected guesses): blocks
        that then hold no slot go back to the pool. Their k/v were never cached (not final), so nobody shares them."""
        blocks = self._require(req_id)
        assert 0 <= num_tokens <= self._num_slots[req_id], f"trim {req_id!r} to {num_tokens} > its slots"
        assert len(self._block_hashes[req_id]) * self.block_size <= num_tokens, f"trim {req_id!r} into a cached block"
        keep = self.num_blocks_needed(num_tokens)
        self.pool.free([b for b in blocks[keep:][::-1] if b != _RELEASED])
        del blocks[keep:]
        self._num_slots[req_id] = num_tokens

    def block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block table, in position order (a released entry reads 0)."""
        return [max(b, 0) for b in self._require(req_id)]

    def num_slots(self, req_id: str) -> int:
        self._require(req_id)
        return self._num_slots[req_id]

    def slot_mapping(self, req_id: str, start: int, end: int) -> np.ndarray:
        """int64 [end - start]: cache slots of positions start..end-1 of the request."""
        blocks = self._require(req_id)
        assert 0 <= start <= end <= self._num_slots[req_id], f"slots {start}..{end} of {req_id!r} not allocated"
        assert start == end or blocks[start // self.block_size] != _RELEASED, f"slot {start} of {req_id!r} released"
        table = np.asarray([blocks], dtype=np.int32).reshape(1, -1)
        positions = np.arange(start, end, dtype=np.int32)
        return slot_ids(table, np.zeros(end - start, dtype=np.int32), positions, self.block_size)

    def free(self, req_id: str) -> None:
        """Let go of all of the request's blocks. Freeing an unknown or already freed request raises.

        NOTE (reverse order): the tail blocks go back to the free queue first, so they are evicted before the
        request's first blocks, which are the likeliest to be hit again (a shared system prompt, say).
        """
        blocks = self._require(req_id)
        del self._blocks[req_id]
        del self._num_slots[req_id]
        del self._block_hashes[req_id]
        self.pool.free([b for b in blocks[::-1] if b != _RELEASED])

    def _require(self, req_id: str) -> list[int]:
        try:
            return self._blocks[req_id]
        except KeyError:
            msg = f"request {req_id!r} holds no KV cache blocks (never allocated or already freed)"
            raise ValueError(msg) from None


# ----------------------------------------------------------------------------------------------------------
# Sizing


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: str) -> int:
    """Bytes one block takes over all layers: k and v, [block_size, n_kv_heads, head_dim] each (an int8 cache's
    with its scales: llmc/dtypes.py kv_block_bytes)."""
    return 2 * num_layers * kv_block_bytes(kv_dtype, block_size, num_kv_heads, head_dim)


def blocks_for_memory(budget_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in `budget_bytes` (0 if none)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    return max(0, int(budget_bytes) // bytes_per_block)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_memory_size(text: str | int) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, '1.5g', '1024' (bytes). Raises ValueError."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 4GiB, 512MB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def mem_available_bytes(meminfo_path: str = "/proc/meminfo") -> int:
    """MemAvailable from /proc/meminfo, in bytes (Linux)."""
    with open(meminfo_path) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                assert unit == "kB", line
                return int(value) * 1024
    raise ValueError(f"{meminfo_path} has no MemAvailable line")


def kv_cache_budget_bytes(
    kv_cache_memory: str | int | None = None, memory_fraction: float = 0.5, free_bytes: int | None = None
) -> int:
    """Bytes for the KV cache: `kv_cache_memory` if given (e.g. '4GiB'), else `memory_fraction` of free memory.

    free_bytes: free device memory (the CUDA module reports it); None = CPU, MemAvailable from /proc/meminfo.
    A CPU module reads its weights into memory as it is created: CompiledModel.load passes free memory less them.
    """
    if kv_cache_memory is not None:
        return parse_memory_size(kv_cache_memory)
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if free_bytes is None:
        free_bytes = mem_available_bytes()
    return int(free_bytes * memory_fraction)
