"""Paged KV cache bookkeeping: which block belongs to which request (docs/contracts.md, "KV cache").

The compiled module owns the storage, `[2, num_blocks, block_size, n_kv_heads, head_dim]` per layer; this
module alone owns the assignment of blocks to requests (one source of truth: nothing else allocates).

- `BlockPool`: the blocks, a FIFO free queue, checked frees.
- `KVCacheManager`: per-request block tables on top of the pool. Running out of blocks is a return value
  (`allocate_slots` -> False); misuse (double free, unknown request) raises ValueError.
- Sizing: `kv_bytes_per_block`, `blocks_for_memory`, `kv_cache_budget_bytes` (--kv-cache-memory or a
  fraction of available memory).
"""

from __future__ import annotations

import re
from collections import deque

import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_ids(block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each token: block_tables[seq, pos // block_size] * block_size + pos % block_size.

    block_tables: int [B, max_blocks]; seq_index, positions: int [T]. Returns int64 [T] (the ABI's
    slot_mapping). The one place the slot formula lives.
    """
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    return blocks * block_size + (positions % block_size)


class BlockPool:
    """The blocks and their free queue.

    Allocation pops from the front of the free queue; freeing appends to the back, so a block freed just
    now is reused last. Every block is either in the free queue or in use, never both: `free` checks it.
    NOTE (checked frees): a block freed twice would sit twice in the free queue and later be handed to two
    requests, which then overwrite each other's k/v silently (vLLM issue #42571). The `_in_use` flags make
    that an immediate error instead.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_use = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to allocate) first. For tests and debugging."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        assert 0 <= n <= len(self._free), f"allocate({n}) with {len(self._free)} free blocks"
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._in_use[b] = True
        return out

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:  # check everything before changing anything
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"free: block {b} is not in the pool (0..{self.num_blocks - 1})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"free: the same block appears twice in {block_ids}")
        for b in block_ids:
            if not self._in_use[b]:
                raise ValueError(f"free: block {b} is already free (double free)")
        for b in block_ids:
            self._in_use[b] = False
            self._free.append(b)


_RELEASED = -1  # a block-table entry whose block slid out of the attention window and went back to the pool


class KVCacheManager:
    """Per-request block tables over a `BlockPool` of `num_blocks` blocks of `block_size` tokens.

    A request that has called `allocate_slots` at least once owns a (possibly empty) block table until
    `free(req_id)`. `num_slots(req_id)` counts the token slots handed out so far; they are contiguous
    positions 0..num_slots-1, and the block table always has exactly cdiv(num_slots, block_size) entries.

    sliding_window W > 0 (every layer attends to the last W positions only): a query at position p never
    reads keys before p - W + 1, so `allocate_slots` first releases the blocks that lie wholly before the
    window of the chunk it allocates for. Their table entries read 0 in `block_ids`; no kernel reads them.
    """

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}

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

    def allocate_slots(self, req_id: str, num_new_tokens: int) -> bool:
        """Give `req_id` cache slots for `num_new_tokens` more tokens; False (and no change) if out of blocks.

        ```
        |<------------ num_slots (already held) ------------>|<--- num_new_tokens --->|
        | block 0 | block 1 | ... | last block: used | spare  | new block | new block  |
                                                    ^ filled first, then new blocks from the free queue
        ```
        A new request (first call) gets an empty table first. num_new_tokens == 0 is allowed. With a sliding
        window, blocks the new tokens' window has left are released first, even when the call returns False.
        """
        assert num_new_tokens >= 0, f"allocate_slots({req_id!r}, {num_new_tokens})"
        blocks = self._blocks.get(req_id, [])
        num_slots = self._num_slots.get(req_id, 0)
        if self.sliding_window:
            self._release_before(blocks, num_slots - self.sliding_window + 1)
        need = self.num_blocks_needed(num_slots + num_new_tokens) - len(blocks)
        if need > self.pool.num_free_blocks:
            return False
        if req_id not in self._blocks:
            self._blocks[req_id] = blocks
        blocks.extend(self.pool.allocate(max(need, 0)))
        self._num_slots[req_id] = num_slots + num_new_tokens
        return True

    def _release_before(self, blocks: list[int], position: int) -> None:
        """Return the blocks that hold only positions < `position` to the pool."""
        for i in range(min(max(position, 0) // self.block_size, len(blocks))):
            if blocks[i] != _RELEASED:
                self.pool.free([blocks[i]])
                blocks[i] = _RELEASED

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
        """Return all of the request's blocks to the pool. Freeing an unknown or already freed request raises.

        NOTE (reverse order): the tail blocks go back to the free queue first, so they are reused before the
        request's first blocks; with prefix sharing (later) the first blocks are the likeliest to be hit again.
        """
        blocks = self._require(req_id)
        del self._blocks[req_id]
        del self._num_slots[req_id]
        self.pool.free([b for b in blocks[::-1] if b != _RELEASED])

    def _require(self, req_id: str) -> list[int]:
        try:
            return self._blocks[req_id]
        except KeyError:
            msg = f"request {req_id!r} holds no KV cache blocks (never allocated or already freed)"
            raise ValueError(msg) from None


# ----------------------------------------------------------------------------------------------------------
# Sizing


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes one block takes over all layers: k and v, [block_size, n_kv_heads, head_dim] each."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def blocks_for_memory(budget_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in `budget_bytes` (0 if none)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    return max(0, int(budget_bytes) // bytes_per_block)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


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
    Weights are mmapped and already counted against free memory once loaded, so size the cache after loading.
    """
    if kv_cache_memory is not None:
        return parse_memory_size(kv_cache_memory)
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if free_bytes is None:
        free_bytes = mem_available_bytes()
    return int(free_bytes * memory_fraction)
