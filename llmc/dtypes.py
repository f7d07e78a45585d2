"""Element types: one table of every dtype llmc names, with each of its spellings.

A dtype has one name in Python, manifests and WeightSpec ("bfloat16", as numpy and torch spell it) and here
its other spellings: its size, the templates' short name (the `wdtype`, `adtype` and `kv_dtype` parameters
and the kernel ids that embed them: "bf16"), the C type a generated pointer to it has (bf16 and fp16 stay
raw uint16_t bits) and the safetensors code ("BF16").

The KV cache, the activations and float packed weights are each one of ELEMENT_DTYPES (a Python name:
`kv_dtype`, `act_dtype`, `weight_dtype`). Which dtypes a stage accepts beyond that (a checkpoint's
float16, a quantized weight's uint8 codes) is that stage's rule, written there in these names.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DType:
    name: str  # "bfloat16": Python, manifests, WeightSpec, torch / numpy
    nbytes: int  # bytes per element
    safetensors: str  # "BF16": the safetensors header's code
    ctype: str  # "uint16_t": the C element type of a generated pointer to it (bf16, fp16: their bits)
    short: str | None = None  # "bf16": the templates' name, in their parameters and kernel ids


_ALL = (
    DType("float64", 8, "F64", "double"),
    DType("float32", 4, "F32", "float", "f32"),
    DType("bfloat16", 2, "BF16", "uint16_t", "bf16"),
    DType("float16", 2, "F16", "uint16_t", "f16"),
    DType("float8_e4m3fn", 1, "F8_E4M3", "uint8_t", "fp8"),
    DType("float8_e5m2", 1, "F8_E5M2", "uint8_t"),
    DType("int64", 8, "I64", "int64_t"),
    DType("int32", 4, "I32", "int32_t"),
    DType("int16", 2, "I16", "int16_t"),
    DType("int8", 1, "I8", "int8_t", "i8"),
    DType("uint64", 8, "U64", "uint64_t"),
    DType("uint32", 4, "U32", "uint32_t"),
    DType("uint16", 2, "U16", "uint16_t"),
    DType("uint8", 1, "U8", "uint8_t"),
    DType("bool", 1, "BOOL", "bool"),
)
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _ALL}

# What the kernels take as an element (a template's wdtype, adtype, kv_dtype): the KV cache, the activations
# and float packed weights are each one of these.
ELEMENT_DTYPES = ("float32", "bfloat16")
# A template parameter's short name -> its element dtype ("bf16" -> bfloat16)
ELEMENTS_BY_SHORT: dict[str, DType] = {DTYPES[n].short: DTYPES[n] for n in ELEMENT_DTYPES}
# What the KV cache may store: an element, or int8 or fp8 (e4m3) with a float32 scale per (token, kv head),
# quantized as it is written (symmetric, the row's largest magnitude at the type's largest value: 127, 448). fp8 is
# a CUDA cache of sm89 and later (FP8_KV_MIN_COMPUTE_CAPABILITY), the generations with fp8 in hardware.
KV_DTYPES = (*ELEMENT_DTYPES, "int8", "float8_e4m3fn")
SCALED_KV_DTYPES = ("int8", "float8_e4m3fn")
KV_DTYPE_SPELLINGS = {"fp8": "float8_e4m3fn"}  # other names a user may give a KV dtype (vLLM's) -> llmc's
FP8_KV_MIN_COMPUTE_CAPABILITY = 89
KV_BY_SHORT: dict[str, DType] = {DTYPES[n].short: DTYPES[n] for n in KV_DTYPES}


def kv_slot_bytes(kv_dtype: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one token's k (or v) takes in the cache: its values, and a scaled cache's scale per kv head."""
    return num_kv_heads * (head_dim * DTYPES[kv_dtype].nbytes + (4 if kv_dtype in SCALED_KV_DTYPES else 0))


def kv_block_bytes(kv_dtype: str, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer's k (or v): its slots, a scaled block padded to 16 bytes so that every
    block's rows stay 16-byte aligned (the model's kKvBlockBytes)."""
    n = block_size * kv_slot_bytes(kv_dtype, num_kv_heads, head_dim)
    return -(-n // 16) * 16 if kv_dtype in SCALED_KV_DTYPES else n


def resolve_kv_dtype(kv_dtype: str, *, cuda: bool, weight_dtype: str) -> str:
    """The KV cache element of a build. "auto" is the build's own precision, as vLLM's: bfloat16 for bf16 / fp16
    weights on a CUDA target (half the cache bytes, and the tensor-core prefill attention reads bf16 tiles),
    float32 otherwise (the CPU target and fp32 builds keep an exact cache)."""
    kv_dtype = KV_DTYPE_SPELLINGS.get(kv_dtype, kv_dtype)
    if kv_dtype != "auto":
        return kv_dtype
    return "bfloat16" if cuda and weight_dtype in ("bfloat16", "float16") else "float32"
