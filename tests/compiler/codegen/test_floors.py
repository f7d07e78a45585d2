"""compiler/codegen/floors.py: each kernel's floor from its parameters and the step's shape, by hand. The
floors against the simulator's distinct bytes of a compiled model: tests/tools/test_profile.py."""

from __future__ import annotations

import pytest

from llmc.compiler.codegen.floors import Floor, StepShape, kernel_floor, launch_floor
from llmc.errors import LlmcError

DECODE = StepShape(((37, 1), (100, 1), (0, 1)), logits_rows=3)
PREFILL = StepShape(((0, 19),), logits_rows=1)


def test_attention_counts_cached_positions_and_pairs():
    assert DECODE.tokens == 3
    assert DECODE.attention(0) == (37 + 100, 38 + 101 + 1)
    # W = 16: each query sees its last 16 positions; of the cache, the newest 15
    assert DECODE.attention(16) == (15 + 15 + 0, 16 + 16 + 1)
    assert PREFILL.attention(0) == (0, 19 * 20 // 2)
    assert PREFILL.attention(8) == (0, sum(range(1, 9)) + 11 * 8)
    # a chunk after a cache of 30 under W = 8: the first new query reaches back 7 cached positions
    assert StepShape(((30, 5),), 1).attention(8) == (7, 5 * 8)


def test_gemm_reads_weights_once_and_rows_of_x_and_y():
    p = {"n": 96, "k": 200, "wdtype": "bf16", "has_bias": True}
    assert launch_floor("cuda/gemm", p, "T", DECODE) == Floor(
        96 * 200 * 2 + 96 * 2 + 3 * (200 + 96) * 4, 2 * 3 * 96 * 200
    )
    assert launch_floor("cuda/gemm", {**p, "wdtype": "f32", "has_bias": False}, "N", PREFILL) == Floor(
        96 * 200 * 4 + 1 * (200 + 96) * 4, 2 * 96 * 200
    )


def test_qgemm_weight_bytes():
    p = {"n": 64, "k": 256, "bits": 4, "group_size": 32, "asymmetric": True, "scale_bits": 16, "has_bias": False}
    groups = 64 * 256 // 32
    assert launch_floor("cuda/qgemm", p, "T", PREFILL).bytes == 64 * 256 // 2 + groups * 2 * 2 + 19 * (256 + 64) * 4
    sym8 = {**p, "bits": 8, "asymmetric": False, "scale_bits": 32}
    assert launch_floor("cuda/qgemm", sym8, "T", PREFILL).bytes == 64 * 256 + groups * 4 + 19 * (256 + 64) * 4


def test_expert_gemms_read_the_chosen_experts_once():
    """At one row, top_k experts' weights; at many, each expert at most once, however many rows chose it."""
    p = {"experts": 8, "n": 64, "k": 32, "top_k": 2, "per_slot": False, "swiglu": True, "wdtype": "bf16"}
    one = launch_floor("cpu/moe_gemm", p, "T", StepShape(((0, 1),), 1))
    assert one.bytes == 2 * 64 * 32 * 2 + (32 + 2 * 32) * 4 + 2 * 2 * 4 and one.flops == 2 * 2 * 64 * 32
    many = launch_floor("cpu/moe_gemm", p, "T", StepShape(((0, 100),), 1))
    assert many.bytes - 100 * (32 + 2 * 32 + 2 * 2) * 4 == 8 * 64 * 32 * 2
    q = {**p, "bits": 4, "group_size": 32, "asymmetric": False, "scale_bits": 16}
    del q["wdtype"]
    assert launch_floor("cpu/moe_qgemm", q, "T", StepShape(((0, 1),), 1)).bytes == 2 * (64 * 16 + 64 * 2) + 96 * 4 + 16


def test_paged_attention_reads_each_cached_position_once_per_kv_head():
    p = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 16, "block_size": 16, "sliding_window": 0, "kv_dtype": "bf16"}
    f = launch_floor("cuda/paged_attention", p, "T", DECODE)
    kv_row = 2 * 2 * 16
    new = 3 * (kv_row * (4 + 2) + 8)
    queries = 3 * 2 * 8 * 16 * 4
    tables = 4 * ((3 + 2) + (7 + 2) + (1 + 2))
    assert f == Floor(new + queries + tables + (37 + 100) * kv_row * 2, 4 * 8 * 16 * (38 + 101 + 1))


def test_a_kernel_sums_its_launches():
    k = {
        "id": "x",
        "template": "cuda/rmsnorm",
        "params": {"hidden": 64, "wdtype": "f32", "add_residual": True},
        "rows": ["T", "N"],
    }
    assert kernel_floor(k, DECODE) == Floor(2 * 64 * 4 + (3 + 3) * 4 * 64 * 4, 0)


@pytest.mark.parametrize(
    "kernel",
    [
        {"id": "old", "template": "cuda/gemm", "params": {"n": 1, "k": 1, "wdtype": "bf16"}},  # no rows
        {"id": "bad", "template": "cuda/gemm", "params": {"n": 1}, "rows": ["T"]},
        {"id": "new", "template": "cuda/conv2d", "params": {}, "rows": ["T"]},
        "not a kernel",
    ],
)
def test_malformed_or_unknown_kernels_are_clear_errors(kernel):
    with pytest.raises(LlmcError):
        kernel_floor(kernel, DECODE)
