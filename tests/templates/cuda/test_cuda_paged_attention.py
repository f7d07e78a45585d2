"""templates/cuda/paged_attention.cu.j2 under the simulator against a float64 numpy reference.

A ragged batch mixes prefill, chunked prefill and decode sequences whose cache blocks are shuffled
and non-contiguous; the cache holds earlier tokens' k/v and garbage elsewhere. q/k/v are column
slices of one fused qkv buffer, as the qkv gemm produces them. Context lengths cross the kernel's
32-position chunks (33, 70 + new tokens).
"""

import math

import numpy as np
import pytest

from llmc.compiler.codegen.render import kernel_id, render_kernel
from llmc.errors import CompileError

# (num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1, 4, 3 (9 heads / 3 kv heads) and 4 (one kv
# head); head_dim 16 / 64 / 8 / 128
CONFIGS = [(4, 4, 16, 4), (8, 2, 64, 16), (9, 3, 8, 8), (4, 1, 128, 1)]
SPECS = [("paged_attention", dict(num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=bs,
                                  scale=1.0 / math.sqrt(hd))) for nh, nkv, hd, bs in CONFIGS]
IDS = [kernel_id("cuda", *s) for s in SPECS]
NUM_BLOCKS = 200

# (cached tokens, new tokens) per sequence
MIXED = [(0, 7), (10, 1), (5, 3), (33, 1), (0, 1), (16, 17), (70, 1)]


@pytest.fixture(scope="module")
def kernels(cuda_kernels):
    return cuda_kernels(SPECS)


class Batch:
    """A random step: history in the cache, new q/k/v rows, block tables from a shuffled pool."""

    def __init__(self, p, seqs, seed):
        rng = np.random.default_rng(seed)
        nh, nkv, hd, bs = p["num_heads"], p["num_kv_heads"], p["head_dim"], p["block_size"]
        self.p, self.seqs, self.B = p, seqs, len(seqs)
        self.T = sum(n for _, n in seqs)
        need = [-(-(c + n) // bs) for c, n in seqs]
        self.max_blocks = max(need) + 1  # a spare column: unused entries are 0
        assert sum(need) <= NUM_BLOCKS
        pool = rng.permutation(NUM_BLOCKS)
        self.block_tables = np.zeros((self.B, self.max_blocks), dtype=np.int32)
        at = 0
        for b, nb in enumerate(need):
            self.block_tables[b, :nb] = pool[at:at + nb]
            at += nb
        shape = (NUM_BLOCKS, bs, nkv, hd)
        self.k_cache = rng.standard_normal(shape, dtype=np.float32) * 100  # garbage unless written
        self.v_cache = rng.standard_normal(shape, dtype=np.float32) * 100
        self.stride = (nh + 2 * nkv) * hd
        self.qkv = rng.standard_normal((self.T, self.stride), dtype=np.float32)
        self.K, self.V = [], []  # per sequence: all k/v rows 0..seq_len-1
        self.qsl = np.zeros(self.B + 1, dtype=np.int32)
        self.seq_lens = np.zeros(self.B, dtype=np.int32)
        self.slots = np.zeros(self.T, dtype=np.int64)
        q_end = nh * hd
        for b, (c, n) in enumerate(seqs):
            t0 = self.qsl[b]
            self.qsl[b + 1] = t0 + n
            self.seq_lens[b] = c + n
            hist_k = rng.standard_normal((c, nkv, hd), dtype=np.float32)
            hist_v = rng.standard_normal((c, nkv, hd), dtype=np.float32)
            for pos in range(c):
                blk, off = self.block_tables[b, pos // bs], pos % bs
                self.k_cache[blk, off], self.v_cache[blk, off] = hist_k[pos], hist_v[pos]
            for i in range(n):
                pos = c + i
                self.slots[t0 + i] = self.block_tables[b, pos // bs] * bs + pos % bs
            new_k = self.qkv[t0:t0 + n, q_end:q_end + nkv * hd].reshape(n, nkv, hd)
            new_v = self.qkv[t0:t0 + n, q_end + nkv * hd:].reshape(n, nkv, hd)
            self.K.append(np.concatenate([hist_k, new_k]))
            self.V.append(np.concatenate([hist_v, new_v]))

    def run(self, fn):
        nh, nkv, hd = self.p["num_heads"], self.p["num_kv_heads"], self.p["head_dim"]
        q = self.qkv[:, :nh * hd]
        k = self.qkv[:, nh * hd:(nh + nkv) * hd]
        v = self.qkv[:, (nh + nkv) * hd:]
        out = np.full((self.T, nh * hd), np.nan, dtype=np.float32)
        fn(q, k, v, self.stride, self.k_cache, self.v_cache, self.slots, self.qsl, self.seq_lens,
           self.block_tables, self.max_blocks, self.B, out)
        return out

    def reference(self):
        nh, nkv, hd = self.p["num_heads"], self.p["num_kv_heads"], self.p["head_dim"]
        group = nh // nkv
        out = np.zeros((self.T, nh, hd))
        for b, (c, n) in enumerate(self.seqs):
            K, V = self.K[b].astype(np.float64), self.V[b].astype(np.float64)
            for i in range(n):
                t = self.qsl[b] + i
                q = self.qkv[t, :nh * hd].reshape(nh, hd).astype(np.float64)
                for h in range(nh):
                    s = K[:c + i + 1, h // group] @ q[h] * self.p["scale"]
                    w = np.exp(s - s.max())
                    out[t, h] = (w / w.sum()) @ V[:c + i + 1, h // group]
        return out.reshape(self.T, nh * hd)


@pytest.mark.parametrize("seqs", [MIXED, [(0, 17)], [(40, 1), (3, 1), (0, 1)]], ids=["mixed", "prefill", "decode"])
@pytest.mark.parametrize("op,params", SPECS, ids=IDS)
def test_paged_attention_matches_numpy(kernels, op, params, seqs):
    batch = Batch(params, seqs, seed=len(seqs))
    k_before, v_before = batch.k_cache.copy(), batch.v_cache.copy()
    out = batch.run(kernels[kernel_id("cuda", op, params)])
    np.testing.assert_allclose(out, batch.reference(), rtol=1e-5, atol=2e-6)

    # this step's k/v went to their slots, and nothing else in the cache changed
    nh, nkv, hd = params["num_heads"], params["num_kv_heads"], params["head_dim"]
    flat_k, flat_v = k_before.reshape(-1, nkv, hd), v_before.reshape(-1, nkv, hd)
    flat_k[batch.slots] = batch.qkv[:, nh * hd:(nh + nkv) * hd].reshape(-1, nkv, hd)
    flat_v[batch.slots] = batch.qkv[:, (nh + nkv) * hd:].reshape(-1, nkv, hd)
    assert np.array_equal(batch.k_cache, k_before) and np.array_equal(batch.v_cache, v_before)


def test_paged_attention_skips_padding_slots(kernels):
    """A negative slot (padding token) writes nothing to the cache."""
    op, params = SPECS[2]
    batch = Batch(params, [(5, 3), (2, 1)], seed=9)
    batch.slots[1] = -1
    k_before = batch.k_cache.copy()
    batch.run(kernels[kernel_id("cuda", op, params)])
    nh, nkv, hd = params["num_heads"], params["num_kv_heads"], params["head_dim"]
    flat = k_before.reshape(-1, nkv, hd)
    keep = batch.slots >= 0
    flat[batch.slots[keep]] = batch.qkv[keep, nh * hd:(nh + nkv) * hd].reshape(-1, nkv, hd)
    assert np.array_equal(batch.k_cache, k_before)


def test_paged_attention_sequence_independent_of_batch(kernels):
    """A sequence's outputs are bit-identical alone and inside a mixed batch."""
    op, params = SPECS[2]  # 9 heads / 3 kv heads
    fn = kernels[kernel_id("cuda", op, params)]
    mixed = Batch(params, MIXED, seed=11)
    cache = mixed.k_cache.copy(), mixed.v_cache.copy()
    out_mixed = mixed.run(fn)
    for b in (0, 5, 6):
        alone = Batch(params, MIXED, seed=11)  # same random draw, then cut down to sequence b
        t0, t1 = mixed.qsl[b], mixed.qsl[b + 1]
        alone.k_cache, alone.v_cache = cache[0].copy(), cache[1].copy()
        alone.qkv = np.ascontiguousarray(mixed.qkv[t0:t1])
        alone.slots = mixed.slots[t0:t1].copy()
        alone.qsl = np.array([0, t1 - t0], dtype=np.int32)
        alone.seq_lens = mixed.seq_lens[b:b + 1].copy()
        alone.block_tables = np.ascontiguousarray(mixed.block_tables[b:b + 1])
        alone.B, alone.T = 1, int(t1 - t0)
        assert np.array_equal(alone.run(fn), out_mixed[t0:t1])


@pytest.mark.parametrize("op,params", [SPECS[1], SPECS[2]], ids=[IDS[1], IDS[2]])
def test_paged_attention_independent_of_thread_order(kernels, sim_seed, op, params):
    """Two scheduling seeds (thread and block order) give bit-identical outputs and caches."""
    fn = kernels[kernel_id("cuda", op, params)]
    results = []
    for seed in (1, 2):
        sim_seed(seed)
        batch = Batch(params, MIXED, seed=4)
        results.append((batch.run(fn), batch.k_cache, batch.v_cache))
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_paged_attention_rejects_bad_gqa():
    with pytest.raises(CompileError, match="multiple of num_kv_heads"):
        render_kernel("cuda", "paged_attention", name="a", num_heads=9, num_kv_heads=2, head_dim=8, block_size=4,
                      scale=0.35)
