"""References and input builders of the kernel template tests (tests/templates/test_<op>.py, on every target).

Plain numpy / torch, no kernels: what each op must compute, and the random inputs the tests hand the kernels.
T is the number of token rows; weights come as (array to pass the kernel, the float32 values it holds). torch is
imported only by the rope functions: the ASan child process (cuda/test_cuda_asan.py) imports this module too.
"""

from __future__ import annotations

import copy
import re

import numpy as np

# ---------------------------------------------------------------------------------------------------
# weights


def to_bf16(a):
    """Round float32 to bf16 (nearest even). Returns (uint16 bits, the float32 values they hold)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, bf16_bits_of(bits)


def make_weights(a, wdtype):
    """(array to pass the kernel, float32 values it holds) for wdtype f32 | bf16; activations (adtype) too."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if wdtype == "f32":
        return a, a
    assert wdtype == "bf16", wdtype
    return to_bf16(a)


def act_empty(shape, adtype):
    """An output of activations (adtype f32 | bf16) filled with NaN, to show what the kernel leaves unwritten."""
    return np.full(shape, np.nan, np.float32) if adtype == "f32" else np.full(shape, 0x7FC0, np.uint16)


def bf16_bits_of(a):
    """bf16 activations from a kernel: the uint16 bits as the float32 values they hold."""
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------------
# embedding: out[t] = table[ids[t]]


def quantized_weight(w, scheme, rng):
    """compiler/quant.py's quantize(w, scheme), or for K-quant records at 5 or 8 bits (GGUF Q5_K, which llmc's
    quantizer does not write), 3 (Q3_K) and 2 (Q2_K) random q under random records: every code a file may hold,
    not only those a quantizer picks."""
    from llmc.compiler import kquant
    from llmc.compiler.quant import QuantizedTensor, quantize

    if scheme.scale_dtype != "kquant" or scheme.bits in (4, 6):
        return quantize(w, scheme)
    n, k = w.shape
    half = (n, k // kquant.SUPERBLOCK)
    if scheme.bits == 2:  # Q2_K: 4-bit scale and min codes, fp16 d and dmin
        halves = (rng.random((*half, 2)) * 0.004).astype(np.float16).view(np.uint8).reshape(*half, 4)
        records = np.concatenate([rng.integers(0, 256, (*half, 16), dtype=np.uint8), halves], -1).reshape(n, -1)
        q = rng.integers(0, 4, (n, k)).astype(np.int8)
        return QuantizedTensor(q, *kquant.decode_q2k(records), scheme, np.ascontiguousarray(records))
    if scheme.bits == 3:  # Q3_K: 6-bit codes less 32 in Q6_K's record
        records = kquant.encode6((rng.random(half) * 0.004).astype(np.float16), rng.integers(-32, 32, (*half, 16)))
        return QuantizedTensor(
            rng.integers(-4, 4, (n, k)).astype(np.int8), kquant.decode6(records), None, scheme, records
        )
    d, dmin = ((rng.random(half) * 0.004).astype(np.float16) for _ in range(2))
    sc, m = (rng.integers(0, 64, (*half, kquant.GROUPS)) for _ in range(2))
    records = kquant.encode(d, dmin, sc, m)
    q = rng.integers(0, 32, (n, k)).astype(np.int8)
    return QuantizedTensor(q, *kquant.decode(records), scheme, records)


def embedding_inputs(T, hidden, wdtype, vocab, seed):
    """ids [T] int32 (ids[0] = vocab - 1, the last row; ids[1] = ids[2] when T > 2), and the table
    [vocab, hidden] as (array to pass the kernel, float32 values)."""
    rng = np.random.default_rng(seed)
    table, table_f = make_weights(rng.standard_normal((vocab, hidden), dtype=np.float32), wdtype)
    ids = rng.integers(0, vocab, size=T, dtype=np.int32)
    ids[:1] = vocab - 1
    if T > 2:
        ids[1] = ids[2]
    return ids, table, table_f


# ---------------------------------------------------------------------------------------------------
# rmsnorm: y = w * (h / sqrt(mean(h^2) + eps)), h = x (+ residual_in -> residual_out)


def rmsnorm_inputs(T, hidden, wdtype, add_residual, seed):
    """x [T, hidden] (std 3), w [hidden] as (array to pass the kernel, float32 values), residual_in [T, hidden]
    (None without add_residual) and the NaN-filled outputs residual_out [T, hidden] (or None) and y [T, hidden]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, hidden), dtype=np.float32) * 3
    w, wf = make_weights(rng.standard_normal(hidden, dtype=np.float32), wdtype)
    res_in = rng.standard_normal((T, hidden), dtype=np.float32) if add_residual else None
    res_out = np.full((T, hidden), np.nan, dtype=np.float32) if add_residual else None
    y = np.full((T, hidden), np.nan, dtype=np.float32)
    return x, w, wf, res_in, res_out, y


def rmsnorm_reference(h, wf, eps):
    """h [T, hidden] (x, or the float32 sum x + residual_in), wf [hidden] float32 -> y [T, hidden] float64."""
    h = h.astype(np.float64)
    return wf * (h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + np.float32(eps)))


# ---------------------------------------------------------------------------------------------------
# gemm: y = x @ w.T + bias, w in HF Linear layout [n, k]


def gemm_inputs(n, k, T, wdtype, has_bias, weights, seed=0):
    """x [T, k], w [n, k] (scaled by 1/sqrt(k)) and bias [n] (None without has_bias) as the kernel takes them,
    with wf / bf their float32 values (bf = zeros without bias): (x, w, wf, b, bf). weights: the `weights`
    fixture, i.e. make_weights."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, k), dtype=np.float32)
    w, wf = weights(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k), wdtype)
    b, bf = weights(rng.standard_normal(n, dtype=np.float32), wdtype) if has_bias else (None, np.zeros(n))
    return x, w, wf, b, bf


def assert_gemm_close(y, x, wf, bf):
    """y [T, n] within float32 accumulation error of x @ wf.T + bf, relative to the magnitude of the terms."""
    ref = x.astype(np.float64) @ wf.astype(np.float64).T + bf
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64).T + np.abs(bf)
    err = np.abs(y - ref)
    assert np.all(err <= 1e-5 * mag + 1e-7), f"max rel err {np.max(err / (mag + 1e-30)):.3g}"


# ---------------------------------------------------------------------------------------------------
# rope: transformers' Llama rotary embedding (rotate-half), in place on heads [0, num_heads) of each row


def assert_softcapped(capped, y, cap):
    """A soft-capped GEMM's output is cap * tanh(y / cap) of the plain GEMM's y (the same sums), within float32
    rounding of that function (the CPU's through its SIMD exp), and never past the cap."""
    want = cap * np.tanh(np.asarray(y, np.float64) / cap)
    np.testing.assert_allclose(capped, want, rtol=1e-6, atol=1e-6 * cap)
    assert np.abs(capped).max(initial=0.0) <= cap


def rope_inv_freq(head_dim, theta):
    """[head_dim / 2] torch float32, as transformers' default rope init computes it."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_inputs(T, row_stride, seed):
    """x [T, row_stride] float32 and positions [T] int32 in [0, 8192): positions[0] = 0, and a large angle
    (131071) in the last row when T > 2."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, row_stride), dtype=np.float32)
    positions = rng.integers(0, 8192, size=T, dtype=np.int32)
    positions[0] = 0
    if T > 2:
        positions[-1] = 131071
    return x, positions


def rope_reference(x, positions, inv_freq):
    """x [T, H, D] float32, positions [T] -> [T, H, D] float32, the leading 2 * len(inv_freq) dims of each head
    rotated (the rest passed, as Phi-3's apply_rotary_pos_emb passes them).

    transformers.models.llama: LlamaRotaryEmbedding.forward + apply_rotary_pos_emb, float32."""
    import torch

    inv = torch.tensor(inv_freq, dtype=torch.float32)
    pos = torch.from_numpy(positions)[None, :].float()
    freqs = (inv[None, :, None] @ pos[:, None, :]).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[0, :, None, :], emb.sin()[0, :, None, :]  # [T, 1, D]
    whole = torch.from_numpy(x)
    q = whole[..., : emb.shape[-1]]
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return torch.cat(((q * cos) + (rotated * sin), whole[..., emb.shape[-1] :]), dim=-1).numpy()


def emitted_floats(src, table):
    """The float32 values of the `float` literals in the brace initialiser after `table` in rendered source."""
    body = src[src.index("{", src.index(table)) + 1 : src.index("};")]
    return np.array([float(v) for v in re.findall(r"([-+0-9.eE]+)f", body)], dtype=np.float32)


# ---------------------------------------------------------------------------------------------------
# silu_mul: out = silu(gate) * up, gate_up = [gate | up] per row


def silu_mul_inputs(T, inter, seed):
    """gate_up [T, 2 * inter] float32 (std 4), its first row (if any) starting -100, 100, 0, -0 (exp overflow /
    saturation / zero)."""
    rng = np.random.default_rng(seed)
    gate_up = (rng.standard_normal((T, 2 * inter), dtype=np.float32) * 4).astype(np.float32)
    gate_up[:1, :4] = [-100.0, 100.0, 0.0, -0.0]
    return gate_up


def silu_mul_reference(gate_up):
    """gate_up [T, 2 * inter] -> [T, inter] float64."""
    inter = gate_up.shape[1] // 2
    g, u = gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64)
    return g / (1.0 + np.exp(-g)) * u


# ---------------------------------------------------------------------------------------------------
# paged attention

NUM_BLOCKS = 600  # cache blocks in the pool (the longest batch at block size 1 takes 503)

# (cached tokens, new tokens) per sequence: prefill, decode, chunked prefill; contexts cross 32 positions
MIXED = [(0, 7), (10, 1), (5, 3), (33, 1), (0, 1), (16, 17), (70, 1)]


class Batch:
    """A random step: history in the cache, new q/k/v rows, block tables from a shuffled pool.

    p: the paged_attention params (num_heads nh, num_kv_heads nkv, head_dim hd, block_size bs, scale,
       sliding_window);
    seqs: (cached tokens, new tokens) per sequence. Arrays, as the kernel takes them:
      qkv [T, stride = (nh + 2 nkv) hd] float32, q | k | v columns (q/k/v are column slices of it)
      k_cache, v_cache [NUM_BLOCKS, bs, nkv, hd] float32: the history at its positions, garbage elsewhere
      slots [T] int64 (block * bs + offset of each new token), qsl [B + 1] int32 (query_start_loc),
      seq_lens [B] int32 (cached + new), block_tables [B, max_blocks] int32 (a spare column; unused entries 0)
    K, V: per sequence, every k/v row 0..seq_len-1, [seq_len, nkv, hd] float32.
    """

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
            self.block_tables[b, :nb] = pool[at : at + nb]
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
            new_k = self.qkv[t0 : t0 + n, q_end : q_end + nkv * hd].reshape(n, nkv, hd)
            new_v = self.qkv[t0 : t0 + n, q_end + nkv * hd :].reshape(n, nkv, hd)
            self.K.append(np.concatenate([hist_k, new_k]))
            self.V.append(np.concatenate([hist_v, new_v]))

    def run(self, fn):
        """Call the kernel on this step; returns out [T, nh * hd] of qkv's dtype (float32, or uint16: bf16
        activations); the caches are written in place."""
        nh, nkv, hd = self.p["num_heads"], self.p["num_kv_heads"], self.p["head_dim"]
        q = self.qkv[:, : nh * hd]
        k = self.qkv[:, nh * hd : (nh + nkv) * hd]
        v = self.qkv[:, (nh + nkv) * hd :]
        out = act_empty((self.T, nh * hd), "bf16" if self.qkv.dtype == np.uint16 else "f32")
        fn(
            q,
            k,
            v,
            self.stride,
            self.k_cache,
            self.v_cache,
            self.slots,
            self.qsl,
            self.seq_lens,
            self.block_tables,
            self.max_blocks,
            self.B,
            self.T,
            out,
        )
        return out

    def reference(self):
        """Causal GQA attention of each new token over its sequence's K/V (the last sliding_window positions
        when that is > 0; scores soft-capped with softcap), in float64: [T, nh * hd]."""
        nh, nkv, hd = self.p["num_heads"], self.p["num_kv_heads"], self.p["head_dim"]
        group, window = nh // nkv, self.p["sliding_window"]
        out = np.zeros((self.T, nh, hd))
        for b, (c, n) in enumerate(self.seqs):
            K, V = self.K[b].astype(np.float64), self.V[b].astype(np.float64)
            for i in range(n):
                t = self.qsl[b] + i
                q = self.qkv[t, : nh * hd].reshape(nh, hd).astype(np.float64)
                lo = max(0, c + i + 1 - window) if window else 0
                for h in range(nh):
                    s = K[lo : c + i + 1, h // group] @ q[h] * self.p["scale"]
                    if "softcap" in self.p:
                        s = self.p["softcap"] * np.tanh(s / self.p["softcap"])
                    w = np.exp(s - s.max())
                    out[t, h] = (w / w.sum()) @ V[lo : c + i + 1, h // group]
        return out.reshape(self.T, nh * hd)

    def cache_after(self, k_before, v_before):
        """The caches as the step must leave them: copies of k_before / v_before [NUM_BLOCKS, bs, nkv, hd] with
        this step's new k/v rows at their slots; a negative slot (a padding token) writes nothing."""
        nh, nkv, hd = self.p["num_heads"], self.p["num_kv_heads"], self.p["head_dim"]
        keep = self.slots >= 0
        k, v = k_before.copy(), v_before.copy()
        k.reshape(-1, nkv, hd)[self.slots[keep]] = self.qkv[keep, nh * hd : (nh + nkv) * hd].reshape(-1, nkv, hd)
        v.reshape(-1, nkv, hd)[self.slots[keep]] = self.qkv[keep, (nh + nkv) * hd :].reshape(-1, nkv, hd)
        return k, v

    def alone(self, b, cache):
        """Sequence b of this step as a batch of its own (B = 1), on copies of cache = (k_cache, v_cache)."""
        t0, t1 = self.qsl[b], self.qsl[b + 1]
        one = copy.copy(self)
        one.seqs, one.K, one.V = [self.seqs[b]], [self.K[b]], [self.V[b]]
        one.k_cache, one.v_cache = cache[0].copy(), cache[1].copy()
        one.qkv = np.ascontiguousarray(self.qkv[t0:t1])
        one.slots = self.slots[t0:t1].copy()
        one.qsl = np.array([0, t1 - t0], dtype=np.int32)
        one.seq_lens = self.seq_lens[b : b + 1].copy()
        one.block_tables = np.ascontiguousarray(self.block_tables[b : b + 1])
        one.B, one.T = 1, int(t1 - t0)
        return one


# ---------------------------------------------------------------------------------------------------
# qgemm: y = x_hat @ dequant(w)^T, x_hat the kernel's int8-per-32 activations


def quantize_activations(x):
    """(x_hat float64 [T, k] = the values the kernel's int8 activations hold, d float32 [T, k/32] per block)."""
    T, k = x.shape
    blocks = x.reshape(T, k // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(blocks * inv[..., None])  # float32 product, ties to even: as the kernel rounds
    assert np.abs(q).max() <= 127
    return (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(T, k), d


def qgemm_reference(x, t, bias):
    """(y float64 [T, n] for the quantized activations, a bound on the kernel's float32 rounding, and the bound on
    the activation quantization's error against the unquantized x)."""
    k, g = t.shape[1], t.scheme.group_size
    x_hat, d = quantize_activations(x)
    qs = t.q.astype(np.float64) * np.repeat(t.scales, g, axis=1)[:, :k]
    m = np.zeros_like(qs) if t.mins is None else np.repeat(t.mins, g, axis=1)[:, :k].astype(np.float64)
    y = x_hat @ (qs - m).T + (0.0 if bias is None else bias.astype(np.float64))
    magnitude = np.abs(x_hat) @ (np.abs(qs) + np.abs(m)).T + (0.0 if bias is None else np.abs(bias))
    half_step = np.repeat(d.astype(np.float64), 32, axis=1) / 2
    from llmc.compiler.quant import dequantize

    quant_err = half_step @ np.abs(dequantize(t).astype(np.float64)).T
    return y, 1e-5 * magnitude, quant_err
