"""The floor of each kernel of a step, from its template parameters and the step's shape: the fewest bytes
it must move through DRAM (every input read once, every output written once) and the FLOPs it must do.
`llmc profile` without the simulator (on a GPU, or a CPU artifact on its host), where no counter sees the
bytes, puts each kernel's measured time against these. The CPU and CUDA templates of an op take the same
parameters, so one model serves both.

A kernel here is a manifest kernel (one rendered template), launched once per `rows` entry over the step's
tokens (T) or its logits rows (N). Activations take the kernel's adtype (CUDA; fp32 where a template has
none, as on the CPU); weights, biases and the KV cache take their recorded dtypes. Paged attention's floor
covers its KV write and the attention: the new tokens' keys and values are read from the QKV buffer and
stored once, and each sequence reads the cached positions its queries can see once for all its query heads
(GQA), whatever the split of the work. TVM's fallback (tvm_call, float32 tensors only) states its tensors'
shapes but not its arithmetic: its floor is their bytes, with no FLOPs. A mixture-of-experts GEMM reads the
weights of the experts its rows chose, once each (moe_experts_read: exact at batch 1).
"""

from __future__ import annotations

import dataclasses
import math

from llmc.dtypes import DTYPES, ELEMENTS_BY_SHORT, KV_BY_SHORT, kv_slot_bytes
from llmc.errors import LlmcError
from llmc.kernel_program import EXPERT_GEMMS

from ..quant import QuantScheme

_F32 = DTYPES["float32"].nbytes


def _bytes(short: str) -> int:
    """Bytes of a template's element (wdtype, adtype, kv_dtype: "f32", "bf16")."""
    return ELEMENTS_BY_SHORT[short].nbytes


@dataclasses.dataclass(frozen=True)
class StepShape:
    """seqs: (cached, new) tokens per sequence; logits_rows: the rows the step returns logits for."""

    seqs: tuple[tuple[int, int], ...]
    logits_rows: int

    @property
    def tokens(self) -> int:
        return sum(new for _, new in self.seqs)

    def rows(self, var: str) -> int:
        return self.logits_rows if var == "N" else self.tokens

    def attention(self, window: int) -> tuple[int, int]:
        """(cached positions some new query sees, query-key pairs), over the sequences; a query at position p
        sees p-W+1..p under a window W, else 0..p."""
        cached_read = pairs = 0
        for cached, new in self.seqs:
            first = max(0, cached - window + 1) if window else 0
            cached_read += cached - min(first, cached)
            pairs += sum(min(p + 1, window) if window else p + 1 for p in range(cached, cached + new))
        return cached_read, pairs


@dataclasses.dataclass(frozen=True)
class Floor:
    bytes: int
    flops: int

    def __add__(self, other: Floor) -> Floor:
        return Floor(self.bytes + other.bytes, self.flops + other.flops)


def _act(p: dict) -> int:
    """Bytes per activation element."""
    return _bytes(p.get("adtype", "f32"))


def _gemm(p: dict, rows: int, weight_bytes: int, bias_bytes: int) -> Floor:
    n, k = p["n"], p["k"]
    bias = n * bias_bytes if p.get("has_bias") else 0
    return Floor(weight_bytes + bias + rows * (k + n) * _act(p), 2 * rows * n * k)


def _quant_row_bytes(p: dict, k: int) -> int:
    """A packed row of k: its codes and its scales (and mins, or records)."""
    return k * p["bits"] // 8 + QuantScheme.of_kernel(p).scale_row_bytes(k)


def _qweight_bytes(p: dict) -> int:
    return p["n"] * _quant_row_bytes(p, p["k"])


def moe_experts_read(experts: int, top_k: int, rows: int) -> int:
    """The experts a step's rows choose between them: top_k at one row, exact; at more, at most top_k a row and
    at most all (the routing decides how many: this is the bound, all rows choosing apart)."""
    return min(experts, top_k * rows)


def expert_bytes(op: str, p: dict) -> int:
    """One expert's weight bytes in a moe_gemm / moe_qgemm launch."""
    return _qweight_bytes(p) if op == "moe_qgemm" else p["n"] * p["k"] * _bytes(p["wdtype"])


def launch_floor(
    template: str, params: dict, rows_var: str, shape: StepShape, experts_read: int | None = None
) -> Floor:
    """One launch of a <target>/<op> kernel with these template parameters; experts_read: the experts an expert
    GEMM's rows chose (measured: `llmc profile`), else moe_experts_read's."""
    op = template.split("/", 1)[-1]
    p, rows = params, shape.rows(rows_var)
    if op == "gemm":
        w = _bytes(p["wdtype"])
        return _gemm(p, rows, p["n"] * p["k"] * w, w)
    if op == "gemm_swiglu":  # gate and up read, silu(gate) * up written: the [T, 2 * inter] product never is
        n, k = 2 * p["inter"], p["k"]
        return Floor(n * k * _bytes(p["wdtype"]) + rows * (k + p["inter"]) * _act(p), 2 * rows * n * k)
    if op == "qgemm":
        return _gemm(p, rows, _qweight_bytes(p), _F32)
    if op == "embedding":
        return Floor(rows * (4 + p["hidden"] * (_bytes(p["wdtype"]) + _act(p))), 0)
    if op == "qembedding":  # a row's packed bytes, and its scales (and mins)
        return Floor(rows * (4 + _quant_row_bytes(p, p["hidden"]) + p["hidden"] * _act(p)), 0)
    if op == "rmsnorm":
        vectors = 4 if p["add_residual"] else 2  # x (+ residual) in, (sum +) y out
        return Floor(p["hidden"] * _bytes(p["wdtype"]) + rows * vectors * p["hidden"] * _act(p), 0)
    if op == "rope":  # with a per-head norm, its [head_dim] float32 weight too
        norm = 4 * p["head_dim"] if "norm_eps" in p else 0
        return Floor(norm + rows * (4 + 2 * p["num_heads"] * p["head_dim"] * _act(p)), 0)
    if op == "silu_mul":
        return Floor(rows * 3 * p["inter"] * _act(p), 0)
    if op == "gather_rows":
        return Floor(rows * (4 + 2 * p["cols"] * _act(p)), 0)
    if op == "paged_attention":
        kv_row = 2 * p["num_kv_heads"] * p["head_dim"]  # one position's key and value
        cache_row = 2 * kv_slot_bytes(KV_BY_SHORT[p["kv_dtype"]].name, p["num_kv_heads"], p["head_dim"])
        cached, pairs = shape.attention(p["sliding_window"])
        new = rows * (kv_row * _act(p) + cache_row + 8)  # read from the QKV buffer, stored at its slot
        queries = rows * 2 * p["num_heads"] * p["head_dim"] * _act(p)  # q in, the output out
        tables = 4 * sum(-(-(c + n) // p["block_size"]) + 2 for c, n in shape.seqs)  # block tables, lens
        return Floor(new + queries + tables + cached * cache_row, 4 * p["num_heads"] * p["head_dim"] * pairs)
    if op == "moe_route":  # the router's weights, x in, ids and weights out
        w = p["experts"] * p["hidden"] * _bytes(p["wdtype"])
        return Floor(w + rows * (p["hidden"] + 2 * p["top_k"]) * _act(p), 2 * rows * p["experts"] * p["hidden"])
    if op in EXPERT_GEMMS:  # the chosen experts' weights once each, a row in and out per slot
        n, k, top_k = p["n"], p["k"], p["top_k"]
        read = moe_experts_read(p["experts"], top_k, rows) if experts_read is None else experts_read
        expert = expert_bytes(op, p)
        x = rows * (top_k if p["per_slot"] else 1) * k
        out = rows * top_k * (n // 2 if p["swiglu"] else n)
        return Floor(read * expert + (x + out + rows * 2 * top_k) * _act(p), 2 * rows * top_k * n * k)
    if op == "moe_combine":
        return Floor(rows * (p["top_k"] * (p["hidden"] + 1) + p["hidden"]) * _act(p), 0)  # elementwise, as silu_mul
    if op == "tvm_call":
        return Floor(
            sum(math.prod(shape.rows(d) if isinstance(d, str) else d for d in t) for t in p["shapes"]) * _F32, 0
        )
    raise LlmcError(f"no floor model for the {template} kernel (compiled by another llmc)", "recompile the artifact")


def kernel_floor(kernel: dict, shape: StepShape) -> Floor:
    """A manifest kernel entry's launches in one step, summed."""
    rows = kernel.get("rows") if isinstance(kernel, dict) else None
    if not isinstance(rows, list):
        raise LlmcError(
            "the artifact's kernels state no launch rows (compiled by an older llmc)", "recompile the artifact"
        )
    total = Floor(0, 0)
    try:
        for rows_var in rows:
            total = total + launch_floor(kernel["template"], kernel["params"], rows_var, shape)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise LlmcError(
            f"the artifact's kernel {kernel.get('id')} has malformed parameters ({e!r})", "recompile the artifact"
        ) from None
    return total
