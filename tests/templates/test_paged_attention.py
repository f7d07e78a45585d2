"""paged_attention (templates/{cpu,cuda}/paged_attention.*.j2) against a float64 numpy reference.

A ragged batch mixes prefill, chunked prefill and decode sequences whose cache blocks are shuffled
and non-contiguous; the cache holds earlier tokens' k/v and garbage elsewhere. q/k/v are column
slices of one fused qkv buffer, as the qkv gemm produces them. Context lengths cross CUDA's 32-position
chunks (33, 70 + new tokens) and its 64-position KV splits (up to 301). A bf16 cache (kv_dtype bf16) is checked against the same reference over k/v
rounded to bf16 (nearest even) as the kernel must store them, an int8 or (CUDA) fp8 e4m3 cache over k/v quantized
per (position, kv head) as the kernel must store them (fp8 codes as torch's float8_e4m3fn rounds them), within
float32 rounding. On CUDA, a bf16 cache's sequences of 16 or more
new tokens take the tensor-core prefill, whose q and softmax weights are bf16: checked against the reference
over bf16-rounded q, within P's rounding.
"""

import copy
import math

import numpy as np
import pytest
import torch

from llmc.compiler.codegen.render import render_kernel
from llmc.errors import CompileError
from tests.templates.kernel_harness import spec_id, target_params
from tests.templates.kernel_reference import MIXED, Batch, to_bf16

# (num_heads, num_kv_heads, head_dim, block_size, sliding_window, kv_dtype): GQA ratios 1, 4, 3 (9 heads / 3 kv
# heads) and 4 (one kv head); head_dim 16 / 64 / 8 / 128, and 20 and 36 (no multiple of a SIMD vector of 8 or 16
# values); windows that start mid-block (5), span blocks (13), cross a 32-lane chunk (37) and cover a single
# position (1); a bf16 cache with GQA, windows and tail head_dims. CUDA's tensor-core prefill (a bf16 cache,
# head_dim % 16 == 0) takes head_dims 64, 16 and 32, the last with a window across its 32-position key tiles.
CONFIGS = [
    (4, 4, 16, 4, 0, "f32"),
    (8, 2, 64, 16, 0, "f32"),
    (9, 3, 8, 8, 0, "f32"),
    (4, 1, 16, 1, 0, "f32"),
    (4, 1, 128, 1, 0, "f32"),
    (4, 2, 16, 4, 5, "f32"),
    (9, 3, 8, 8, 13, "f32"),
    (9, 3, 8, 8, 37, "f32"),
    (8, 2, 64, 16, 1, "f32"),
    (8, 2, 64, 16, 0, "bf16"),
    (9, 3, 20, 8, 0, "bf16"),
    (4, 1, 36, 5, 0, "bf16"),
    (4, 2, 16, 4, 5, "bf16"),
    (9, 3, 8, 8, 13, "bf16"),
    (9, 3, 20, 8, 37, "bf16"),
    (8, 2, 32, 8, 37, "bf16"),
]
F32_SPECS = [
    (
        "paged_attention",
        dict(
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=hd,
            block_size=bs,
            scale=1.0 / math.sqrt(hd),
            sliding_window=w,
            kv_dtype=kv,
        ),
    )
    for nh, nkv, hd, bs, w, kv in CONFIGS
]
# Gemma 2's soft-capped scores, with a cap (2) that random scores pass: a window mid-block (f32 cache), a bf16
# cache with a window of 13, and a tensor-core prefill's key tiles with a window across them
F32_SPECS += [(op, dict(p, softcap=2.0)) for op, p in (F32_SPECS[i] for i in (5, 13, 15))]
# bf16 activations (q, k, v and out bf16): an f32 cache with GQA 4, bf16 caches with head_dim 64 and 8 (a window
# of 13), and one of head_dim 32 with a window across the tensor-core prefill's key tiles
BF16_SPECS = [(op, dict(p, adtype="bf16")) for op, p in (F32_SPECS[i] for i in (1, 9, 13, 15))]
# An int8 cache: GQA 4 and 3, head_dims 64, 8 and 20 (no whole SIMD vector, nor CUDA's 16-value rows), a window
# mid-block, soft-capped scores
INT8_SPECS = [(op, dict(p, kv_dtype="i8")) for op, p in (F32_SPECS[i] for i in (1, 2, 5, 10, 16))]
# An fp8 (e4m3) cache, CUDA's alone: the int8 cases'
FP8_SPECS = [(op, dict(p, kv_dtype="fp8")) for op, p in INT8_SPECS]
SPECS = F32_SPECS + BF16_SPECS + INT8_SPECS + FP8_SPECS
IDS = [spec_id(s) for s in F32_SPECS]
WINDOWED = [pytest.param(*s, id=IDS[i]) for i, s in enumerate(F32_SPECS) if s[1]["sliding_window"] > 0]
# Under the CUDA simulator, where a mixed batch takes ~60 ms, the batch and schedule test runs GQA 4 and 3 and
# the window across a chunk only, with either cache dtype.
ON_CUDA_TOO = {1, 2, 7, 9, 14}
INDEPENDENCE_CASES = [
    pytest.param(*s, id=IDS[i], marks=[] if i in ON_CUDA_TOO else [pytest.mark.targets("cpu")])
    for i, s in enumerate(F32_SPECS)
] + [
    pytest.param(*s, id=spec_id(s), marks=[] if i == 0 else [pytest.mark.targets("cpu")])
    for i, s in enumerate(INT8_SPECS)
]


class Bf16Batch(Batch):
    """A step on a bf16 cache: the history is stored rounded to bf16, and so are the reference's K/V (history and
    this step's rows), which the kernel must round the same way as it writes them."""

    def __init__(self, p, seqs, seed):
        super().__init__(p, seqs, seed)
        self.k_cache, self.v_cache = to_bf16(self.k_cache)[0], to_bf16(self.v_cache)[0]
        self.K, self.V = [to_bf16(k)[1] for k in self.K], [to_bf16(v)[1] for v in self.V]

    def cache_after(self, k_before, v_before):
        nh, nkv, hd = self.p["num_heads"], self.p["num_kv_heads"], self.p["head_dim"]
        keep = self.slots >= 0
        k, v = k_before.copy(), v_before.copy()
        k.reshape(-1, nkv, hd)[self.slots[keep]] = to_bf16(self.qkv[keep, nh * hd : (nh + nkv) * hd])[0].reshape(
            -1, nkv, hd
        )
        v.reshape(-1, nkv, hd)[self.slots[keep]] = to_bf16(self.qkv[keep, (nh + nkv) * hd :])[0].reshape(-1, nkv, hd)
        return k, v


def flash_rows(target, params, batch):
    """[T] bool: the rows CUDA's tensor-core prefill takes (a bf16 cache, head_dim % 16 == 0 and <= 128, a
    sequence of 16 or more new tokens); the rest are computed in fp32 SIMT."""
    rows = np.zeros(batch.T, dtype=bool)
    hd = params["head_dim"]
    if target != "cuda" or params["kv_dtype"] != "bf16" or hd % 16 or hd > 128:
        return rows
    for b, (_, n) in enumerate(batch.seqs):
        if n >= 16:
            rows[batch.qsl[b] : batch.qsl[b + 1]] = True
    return rows


def assert_matches_reference(out, batch, target, params):
    """fp32 rows within float32 rounding of the reference; tensor-core rows (flash_rows), whose q and softmax
    weights P are bf16, against the reference over bf16-rounded q, within P's rounding (2^-9 relative)."""
    flash = flash_rows(target, params, batch)
    np.testing.assert_allclose(out[~flash], batch.reference()[~flash], rtol=1e-5, atol=2e-6)
    if flash.any():
        nh, hd = params["num_heads"], params["head_dim"]
        rounded = copy.copy(batch)
        rounded.qkv = batch.qkv.copy()
        rounded.qkv[:, : nh * hd] = to_bf16(batch.qkv[:, : nh * hd])[1]
        scale = np.abs(np.concatenate(batch.V)).max()
        np.testing.assert_allclose(out[flash], rounded.reference()[flash], rtol=0, atol=4e-3 * scale)


def quantize_kv(rows, kind):
    """rows [..., hd] float32 -> (codes, float32 scale [...]) of an int8 ("i8") or fp8 ("fp8") cache: s = max |x| /
    the type's largest value (127, 448), codes = x / s rounded to the type, ties to even: int8 values, or e4m3 bits
    as torch's float8_e4m3fn rounds them."""
    s = (np.abs(rows).max(axis=-1) / np.float32(127 if kind == "i8" else 448)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(s[..., None] > 0, rows / s[..., None], 0).astype(np.float32)
    if kind == "i8":
        return np.rint(x).astype(np.int8), s
    return torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy(), s


def dequantize_kv(codes, s, kind):
    values = codes if kind == "i8" else torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    return values.astype(np.float32) * s[..., None]


class ScaledBatch(Batch):
    """A step on an int8 or fp8 cache: each block its [bs, nkv, hd] codes, then [nkv, bs] float32 scales, padded to
    16 bytes (llmc_attention.h KvLayout), as bytes [NUM_BLOCKS, block bytes]. The history is stored quantized, and
    the reference's K/V (history and this step's rows) are the dequantized rows the kernel must store."""

    def __init__(self, p, seqs, seed):
        super().__init__(p, seqs, seed)
        self.kind = p["kv_dtype"]
        self.k_cache, self.v_cache = self._packed(self.k_cache), self._packed(self.v_cache)
        self.K, self.V = [self._dequantized(k) for k in self.K], [self._dequantized(v) for v in self.V]

    def _dequantized(self, rows):
        return dequantize_kv(*quantize_kv(rows, self.kind), self.kind)

    def _packed(self, cache):
        q, s = quantize_kv(cache, self.kind)
        n = cache.shape[0]
        block = np.concatenate([q.reshape(n, -1), s.transpose(0, 2, 1).reshape(n, -1).view(q.dtype)], axis=1)
        pad = -block.shape[1] % 16  # blocks of whole 16-byte pieces
        return np.ascontiguousarray(np.pad(block, ((0, 0), (0, pad))))

    def cache_after(self, k_before, v_before):
        nh, nkv, hd, bs = self.p["num_heads"], self.p["num_kv_heads"], self.p["head_dim"], self.p["block_size"]
        keep = self.slots >= 0
        blocks, offsets = np.divmod(self.slots[keep], bs)
        out = []
        for before, cols in ((k_before, slice(nh * hd, (nh + nkv) * hd)), (v_before, slice((nh + nkv) * hd, None))):
            cache = before.copy()
            q, s = quantize_kv(self.qkv[keep, cols].reshape(-1, nkv, hd), self.kind)
            cache[:, : bs * nkv * hd].reshape(-1, bs, nkv, hd)[blocks, offsets] = q
            scales = cache[:, bs * nkv * hd : bs * nkv * (hd + 4)]
            scales.view(np.float32).reshape(-1, nkv, bs)[blocks, :, offsets] = s
            out.append(cache)
        return tuple(out)


def make_batch(params, seqs, seed):
    return {"bf16": Bf16Batch, "i8": ScaledBatch, "fp8": ScaledBatch}.get(params["kv_dtype"], Batch)(params, seqs, seed)


# long: contexts of 301 and 132 (CUDA: 5 and 3 KV splits of 64 positions or fewer, combined) beside a 70-token
# prefill (2 splits for its last tokens, 1 for its first)
@pytest.mark.parametrize(
    "seqs",
    [MIXED, [(0, 17)], [(40, 1), (3, 1), (0, 1)], [(300, 1), (130, 2), (0, 70)]],
    ids=["mixed", "prefill", "decode", "long"],
)
@pytest.mark.parametrize(
    "op,params",
    [
        *F32_SPECS,
        *INT8_SPECS,
        *(pytest.param(*s, marks=pytest.mark.targets("cuda")) for s in FP8_SPECS),
    ],
    ids=IDS + [spec_id(s) for s in INT8_SPECS + FP8_SPECS],
)
def test_paged_attention_matches_numpy(kernels, target, op, params, seqs):
    batch = make_batch(params, seqs, seed=len(seqs))
    k_before, v_before = batch.k_cache.copy(), batch.v_cache.copy()
    assert_matches_reference(batch.run(kernels(op, params)), batch, target, params)

    # this step's k/v went to their slots (an int8 cache's quantized, with their scales), and nothing else in the
    # cache changed
    k_want, v_want = batch.cache_after(k_before, v_before)
    assert np.array_equal(batch.k_cache, k_want) and np.array_equal(batch.v_cache, v_want)


def test_paged_attention_skips_padding_slots(kernels):
    """A negative slot (padding token) writes nothing to the cache."""
    op, params = F32_SPECS[2]
    batch = make_batch(params, [(5, 3), (2, 1)], seed=9)
    batch.slots[1] = -1
    k_before, v_before = batch.k_cache.copy(), batch.v_cache.copy()
    batch.run(kernels(op, params))
    k_want, v_want = batch.cache_after(k_before, v_before)
    assert np.array_equal(batch.k_cache, k_want) and np.array_equal(batch.v_cache, v_want)


@pytest.mark.parametrize("op,params", INDEPENDENCE_CASES)
def test_paged_attention_independent_of_batch_and_schedule(kernels, schedules, op, params):
    """Outputs and caches are bit-identical in every schedule, and each sequence's outputs are the same alone
    (in the last schedule) as inside the mixed batch (in the first)."""
    fn = kernels(op, params)
    results = []
    for schedule in schedules:
        schedule()
        mixed = make_batch(params, MIXED, seed=11)
        cache = mixed.k_cache.copy(), mixed.v_cache.copy()
        results.append((mixed.run(fn), mixed.k_cache, mixed.v_cache))
    for result in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(result, results[0], strict=True))
    out = results[0][0]
    for b in range(mixed.B):
        assert np.array_equal(mixed.alone(b, cache).run(fn), out[mixed.qsl[b] : mixed.qsl[b + 1]])


@pytest.mark.parametrize("op,params", WINDOWED)
def test_paged_attention_reads_no_block_behind_the_window(kernels, target, op, params):
    """Blocks wholly behind every query's window go back to the pool, and their block-table entries read 0
    (docs/contracts.md, "KV cache"): the kernel must not read them. Block 0 holds other data (garbage or
    another sequence's), so a read of a hole would show in the output."""
    batch = make_batch(params, MIXED, seed=5)
    bs, window = params["block_size"], params["sliding_window"]
    holes = 0
    for b, (cached, _) in enumerate(batch.seqs):
        behind = max(0, cached - window + 1) // bs  # blocks before the first query's window
        batch.block_tables[b, :behind] = 0
        holes += behind
    assert holes > 0
    assert_matches_reference(batch.run(kernels(op, params)), batch, target, params)


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("seqs", [MIXED, [(300, 1), (130, 2), (0, 70)]], ids=["mixed", "long"])
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_paged_attention_bf16_activations(kernels, op, params, seqs):
    """bf16 q, k, v and out: the float32-activation kernel's output over the same bf16 values, rounded once, and
    the same cache."""
    f32, bf16 = make_batch(params, seqs, seed=4), make_batch(params, seqs, seed=4)
    f32.qkv, bf16.qkv = to_bf16(f32.qkv)[1], to_bf16(bf16.qkv)[0]
    want = f32.run(kernels(op, dict(params, adtype="f32")))
    assert np.array_equal(bf16.run(kernels(op, params)), to_bf16(want)[0])
    assert np.array_equal(bf16.k_cache, f32.k_cache) and np.array_equal(bf16.v_cache, f32.v_cache)


def test_paged_attention_rejects_bad_parameters(target):
    with pytest.raises(CompileError, match="multiple of num_kv_heads"):
        render_kernel(
            target,
            "paged_attention",
            name="a",
            **target_params(target, {}),
            num_heads=9,
            num_kv_heads=2,
            head_dim=8,
            block_size=4,
            scale=0.35,
            sliding_window=0,
            kv_dtype="f32",
        )
    with pytest.raises(CompileError, match="sliding_window must be an int >= 0"):
        render_kernel(
            target,
            "paged_attention",
            name="a",
            **target_params(target, {}),
            num_heads=9,
            num_kv_heads=3,
            head_dim=8,
            block_size=4,
            scale=0.35,
            sliding_window=-1,
            kv_dtype="f32",
        )
    with pytest.raises(CompileError, match="kv_dtype must be one of"):
        render_kernel(
            target,
            "paged_attention",
            name="a",
            **target_params(target, {}),
            num_heads=9,
            num_kv_heads=3,
            head_dim=8,
            block_size=4,
            scale=0.35,
            sliding_window=0,
            kv_dtype="f16",
        )
