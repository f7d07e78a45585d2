"""Render kernel templates (templates/<target>/<op>.<ext>.j2) into source text.

One function renders every kernel: `render_kernel(target, op, **params)`. The parameters are exactly
the compile-time parameters of docs/contracts.md ("Kernel templates"); a missing or unknown one is a
CompileError that names the op and the template. `kernel_id(target, op, params)` spells every
parameter that changes the code into one readable, filename- and identifier-safe string (FlashInfer's
URI idea): it names the kernel in the manifest, the tuning database and the build cache.

Templates stay thin: they fill in constants and call inline functions of the target's common header
(`templates/cpu/include/common.h` and the headers it includes), which `target_headers(target)` returns.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import numbers
import re
import struct
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.meta

from llmc.dtypes import ELEMENTS_BY_SHORT, KV_BY_SHORT, kv_block_bytes
from llmc.errors import CompileError
from llmc.templates import TEMPLATE_DIR

from ..kquant import RECORD_KINDS
from ..tuning.space import tune_space

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# --- filters: Python values -> C++ literals ------------------------------------------------------


def _to_f32(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"expected a float, got {value!r}")
    f = struct.unpack("<f", struct.pack("<f", float(value)))[0]
    if not math.isfinite(f):
        raise ValueError(f"{value!r} is not a finite float32")
    return f


def _f32_text(value: Any) -> str:
    """The shortest decimal that reads back as the same float32 (at most 9 digits, always enough)."""
    f = _to_f32(value)
    for digits in range(1, 10):
        text = f"{f:.{digits}g}"
        if _to_f32(float(text)) == f:
            return text
    raise AssertionError("unreachable: 9 significant digits round-trip every float32")


def _f32(value: Any) -> str:
    """A C float literal equal to `value` rounded to float32 (`1e-06f`, `0.125f`, `10000.0f`)."""
    text = _f32_text(value)
    if not any(ch in text for ch in ".en"):
        text += ".0"
    return text + "f"


def _ctype(wdtype: Any) -> str:
    """The C type of a pointer to a template's element (bf16 stays raw uint16_t bits), or to a KV cache's (int8)."""
    if wdtype not in KV_BY_SHORT:
        raise ValueError(f"wdtype must be one of {sorted(KV_BY_SHORT)}, got {wdtype!r}")
    return KV_BY_SHORT[wdtype].ctype


def _cbool(value: Any) -> str:
    if not isinstance(value, bool):
        raise TypeError(f"expected a bool, got {value!r}")
    return "true" if value else "false"


def _cint(value: Any, minimum: int = 1) -> str:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise TypeError(f"expected an int >= {minimum}, got {value!r}")
    return str(int(value))


def scale_ctype(scale_bits: int, asymmetric: bool, codebook: bool = False, group_size: int = 32) -> str:
    """The C type a quantized kernel reads its scales (and mins) as (qgemm's S in docs/contracts.md): fp16 bits,
    float, or one K-quant record each (compiler/kquant.py RECORD_KINDS: Q4_K / Q5_K's llmc::KScales, asymmetric
    groups of 32; Q2_K's llmc::KScales2, of 16; IQ4_XS's llmc::Iq4Scales, a codebook's; Q6_K's llmc::KScales6)."""
    if scale_bits == 8:
        if asymmetric:
            return "llmc::KScales" if group_size == 32 else "llmc::KScales2"
        return "llmc::Iq4Scales" if codebook else "llmc::KScales6"
    return {16: "uint16_t", 32: "float"}[scale_bits]


def weight_bits(bits: int, codebook: bool = False) -> str:
    """The BITS a quantized kernel's template takes: the width, or llmc::kIq4 for the IQ4 codebook."""
    return "llmc::kIq4" if codebook else _cint(bits)


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters.update(f32=_f32, ctype=_ctype, cbool=_cbool, cint=_cint)
    env.globals["scale_ctype"] = scale_ctype
    env.globals["weight_bits"] = weight_bits
    env.globals["kv_block_bytes"] = kv_block_bytes
    return env


# --- per-op checks that a template cannot express -------------------------------------------------


def _check_params(target: str, op: str, params: Mapping[str, Any]) -> None:
    if "adtype" in params and params["adtype"] not in ELEMENTS_BY_SHORT:
        raise ValueError(f"adtype must be one of {sorted(ELEMENTS_BY_SHORT)}, got {params['adtype']!r}")
    if op == "rope":
        hd, freqs = params["head_dim"], params["inv_freq"]
        if not isinstance(hd, int) or hd % 2:
            raise ValueError(f"head_dim must be an even int, got {hd!r}")
        if not isinstance(freqs, (list, tuple)) or not 1 <= len(freqs) <= hd // 2:
            raise ValueError(f"inv_freq must be a list of 1 to head_dim/2 = {hd // 2} floats (R/2: R dims rotate)")
        long = params.get("long_inv_freq")
        if long is not None and (not isinstance(long, (list, tuple)) or len(long) != len(freqs)):
            raise ValueError(f"long_inv_freq must be a list of as many floats as inv_freq ({len(freqs)})")
        if (long is None) != ("attention_factor" not in params):
            raise ValueError("LongRoPE takes long_inv_freq and attention_factor together")
        eps = params.get("norm_eps")
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, float) or not eps > 0):
            raise ValueError(f"norm_eps must be a float > 0 (absent: no per-head norm), got {eps!r}")
    if params.get("activation", "gelu_tanh") != "gelu_tanh":
        raise ValueError(f"activation must be 'gelu_tanh' (absent: silu), got {params['activation']!r}")
    if "wdtype" in params and params["wdtype"] not in ELEMENTS_BY_SHORT:  # the ctype filter takes KV dtypes too
        raise ValueError(f"wdtype must be one of {sorted(ELEMENTS_BY_SHORT)}, got {params['wdtype']!r}")
    for key in ("scale", "residual_scale", "attention_factor"):
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value)):
            raise ValueError(f"{key} must be a finite float (absent: 1), got {value!r}")
    cap = params.get("softcap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, float) or not 0 < cap < math.inf):
        raise ValueError(f"softcap must be a finite float > 0 (absent: none), got {cap!r}")
    if op in ("qgemm", "moe_qgemm"):
        _check_quant(target, params, params["k"])
        if params.get("act_passes", 2) != 2:
            raise ValueError(f"act_passes must be 2 (absent: one pass), got {params['act_passes']!r}")
    if op == "qgemm" and "ldy" in params:
        ldy = params["ldy"]
        if isinstance(ldy, bool) or not isinstance(ldy, int) or ldy <= params["n"]:
            raise ValueError(f"ldy must be an int > n (absent: n), got {ldy!r}")
    if op == "qembedding":
        _check_quant(target, params, params["hidden"])
    if op == "paged_attention":
        nh, nkv = params["num_heads"], params["num_kv_heads"]
        if isinstance(nh, int) and isinstance(nkv, int) and nkv > 0 and nh % nkv:
            raise ValueError(f"num_heads ({nh}) must be a multiple of num_kv_heads ({nkv})")
        w = params["sliding_window"]
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"sliding_window must be an int >= 0 (0: no window), got {w!r}")
        if params["kv_dtype"] not in KV_BY_SHORT:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_BY_SHORT)}, got {params['kv_dtype']!r}")


def _check_quant(target: str, params: Mapping[str, Any], k: Any) -> None:
    """The schemes of compiler/quant.py that the packed layouts (compiler/quant_pack.py) hold, for rows of k: int6,
    int5, int3, int2 and the IQ4 codebook on the CPU only (a CUDA build holds them widened to int8,
    compile.quant_schemes)."""
    bits, g = params["bits"], params["group_size"]
    if bits not in ((4, 8) if target == "cuda" else (2, 3, 4, 5, 6, 8)):
        raise ValueError(
            f"bits must be 8{'' if target == 'cuda' else ', 6, 5, 3, 2'} or 4 on target {target}, got {bits!r}"
        )
    if not isinstance(k, int) or k % 32:
        raise ValueError(f"k must be a multiple of 32 for a quantized weight, got {k!r}")
    groups = {8: (16, 32, 64, 128, k), 6: (16,), 5: (32,), 4: (32, 64, 128), 3: (16,), 2: (16,)}[bits]
    if g not in groups:
        raise ValueError(f"group_size must be one of {sorted(set(groups))} for int{bits}, got {g!r}")
    if params["scale_bits"] not in (16, 32, 8):
        raise ValueError(
            f"scale_bits must be 16 (fp16 scales), 32 or 8 (K-quant records), got {params['scale_bits']!r}"
        )
    codebook = bool(params.get("codebook"))
    if params["scale_bits"] == 8 and ((g, bool(params["asymmetric"]), codebook) not in RECORD_KINDS or k % 256):
        raise ValueError(
            "K-quant scales (scale_bits 8) need asymmetric groups of 32 or 16, symmetric ones of 16 or IQ4's of 32, "
            f"and k a multiple of 256, got group_size {g!r}, k {k!r}"
        )
    if (bits == 2) != (params["scale_bits"] == 8 and params["asymmetric"] and g == 16):
        raise ValueError("int2 weights are Q2_K's: groups of 16 with mins under Q2_K's records, and only they are")
    if (bits in (3, 6)) != (params["scale_bits"] == 8 and not params["asymmetric"] and not codebook):
        raise ValueError(
            "int6 and int3 weights are Q6_K's and Q3_K's: symmetric, under Q6_K's records (scale_bits 8), and only "
            "they are"
        )
    if codebook and (target == "cuda" or (bits, g, bool(params["asymmetric"])) != (4, 32, False)):
        raise ValueError("codebook (IQ4) weights are 4-bit, in symmetric groups of 32, on the CPU")


def template_path(target: str, op: str) -> str:
    """The template of `op` for `target`, relative to the templates folder (`cpu/gemm.cc.j2`)."""
    folder = TEMPLATE_DIR / target
    found = sorted(folder.glob(f"{op}.*.j2")) if folder.is_dir() and _IDENT.match(op) else []
    if len(found) != 1:
        have = sorted(p.name.split(".")[0] for p in folder.glob("*.j2")) if folder.is_dir() else []
        raise CompileError(
            f"no kernel template for op {op!r} on target {target!r} (looked for {folder}/{op}.*.j2)",
            f"templates for this target: {', '.join(have) or 'none'}; add one or let the op fall back",
        )
    return found[0].relative_to(TEMPLATE_DIR).as_posix()


def template_file(target: str, filename: str) -> str:
    """A fixed source file of the target, e.g. `template_file("cpu", "tvm_backend.cc")`."""
    path = TEMPLATE_DIR / target / filename
    if not path.is_file():
        raise CompileError(f"target {target!r} has no file {filename!r} under {TEMPLATE_DIR / target}")
    return path.read_text()


def target_headers(target: str) -> dict[str, str]:
    """Every fixed header of the target (templates/<target>/include and its subfolders), by path relative to
    that folder (`llmc_device.cuh`, `sim/llmc_sim.h`): what goes next to the generated source, in the same
    layout, so that its `#include "..."` lines resolve."""
    folder = TEMPLATE_DIR / target / "include"
    if not folder.is_dir():
        raise CompileError(f"target {target!r} has no header folder {folder}")
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def template_params(target: str, op: str) -> set[str]:
    """The parameters the template of `op` reads."""
    rel = template_path(target, op)
    env = _environment()
    source = env.loader.get_source(env, rel)[0]
    return set(jinja2.meta.find_undeclared_variables(env.parse(source))) - env.globals.keys()


def render_host(template_dir: str, filename: str, **context: Any) -> str:
    """Render a target family's host-side template (`cpu/model.cc.j2`), which includes the kernels."""
    return _environment().get_template(f"{template_dir}/{filename}").render(**context)


# Parameters a template reads only when given (`is defined`): a variant of the op, absent from the others' ids
OPTIONAL_PARAMS = {
    # Qwen3's per-head q / k norm before the rotation; OLMo 2's whole one; Phi-3's LongRoPE
    "rope": {"norm_eps", "norm_over_heads", "long_inv_freq", "attention_factor"},
    "embedding": {"scale"},  # Granite's and Gemma's scaled embedding
    "qembedding": {"scale", "codebook"},  # codebook: IQ4's 4-bit indices (qgemm's and moe_qgemm's too)
    "moe_qgemm": {"codebook"},
    # Granite's scaled branch; Gemma's normed branch; OLMo 2's normed branch added with no norm of the sum
    "rmsnorm": {"residual_scale", "residual_norm", "output_norm"},
    "silu_mul": {"activation"},  # "gelu_tanh": Gemma's GeGLU
    "gemm_swiglu": {"activation"},
    "paged_attention": {"softcap"},  # Gemma 2's soft-capped scores
    "gemm": {"softcap"},  # Gemma 2's soft-capped final logits, the lm_head's epilogue
    # act_passes 2 (CPU): the lm_head's int8 activations in two passes; ldy (CPU): y's row stride, where the GEMM
    # writes a column range of a fused q / k / v whose parts have different schemes
    "qgemm": {"softcap", "act_passes", "ldy", "codebook"},
}


def render_kernel(target: str, op: str, **params: Any) -> str:
    """Render the kernel `op` for `target` with its compile-time parameters (docs/contracts.md)."""
    rel = template_path(target, op)
    space = tune_space(target, op)
    if space is not None:  # tunables not given (not tuned) take the template's defaults
        params = {**space.defaults(), **params}
    where = f"op {op!r} (template {rel}, params {_short(params)})"
    needed = template_params(target, op)
    missing, unknown = sorted(needed - params.keys() - OPTIONAL_PARAMS.get(op, set())), sorted(params.keys() - needed)
    if missing or unknown:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(unknown)}"] if unknown else []
        )
        raise CompileError(
            f"bad parameters for {where}: {'; '.join(parts)}",
            f"the template takes exactly: {', '.join(sorted(needed))}",
        )
    name = params.get("name")
    if not isinstance(name, str) or not _IDENT.match(name):
        raise CompileError(f"bad parameters for {where}: name must be a C identifier, got {name!r}")
    try:
        _check_params(target, op, params)
        return _environment().get_template(rel).render(**params)
    except jinja2.UndefinedError as e:  # a parameter used in a way the signature check missed
        raise CompileError(f"template {rel} of op {op!r} needs a parameter it was not given: {e}") from e
    except (TypeError, ValueError) as e:
        raise CompileError(f"bad parameters for {where}: {e}") from e


# --- kernel identity -------------------------------------------------------------------------------

# How each parameter is spelled in a kernel id; "" spells the value alone (`bf16`).
_ID_PREFIX = {
    "n": "n",
    "k": "k",
    "hidden": "h",
    "inter": "i",
    "cols": "c",
    "num_heads": "qh",
    "num_kv_heads": "kvh",
    "head_dim": "d",
    "block_size": "bs",
    "eps": "eps",
    "scale": "sc",
    "softcap": "cap",
    "act_passes": "ap",
    "ldy": "ldy",
    "wdtype": "",
    "has_bias": "bias",
    "add_residual": "res",
    "inv_freq": "if",
    "long_inv_freq": "lif",
    "attention_factor": "af",
    "sliding_window": "sw",
    "kv_dtype": "kv",
    "adtype": "act",
    "bits": "int",
    "group_size": "g",
    "asymmetric": "asym",
    "scale_bits": "s",
    "codebook": "cb",
    "prefetch_bytes": "pf",
    "task_bytes": "task",
    "gemv_warps": "gw",
    "tile_m": "tm",
    "tile_n": "tn",
    "tile_k": "tk",
}
# Canonical order per op (docs/contracts.md); parameters not listed follow, sorted.
_ID_ORDER = {
    "embedding": ["hidden", "wdtype", "adtype"],
    "rmsnorm": ["hidden", "eps", "wdtype", "add_residual", "adtype"],
    "gemm": ["n", "k", "wdtype", "has_bias", "adtype"],
    "gemm_swiglu": ["inter", "k", "wdtype", "adtype"],
    "rope": ["num_heads", "head_dim", "inv_freq", "adtype"],
    "paged_attention": [
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "block_size",
        "scale",
        "sliding_window",
        "kv_dtype",
        "adtype",
    ],
    "silu_mul": ["inter", "adtype"],
    "gather_rows": ["cols", "adtype"],
    "qgemm": ["n", "k", "bits", "group_size", "asymmetric", "scale_bits", "codebook", "has_bias", "adtype"],
    "qembedding": ["hidden", "bits", "group_size", "asymmetric", "scale_bits", "codebook", "adtype"],
}
_LIST_INLINE_MAX = 4  # longer lists are spelled as length + content hash


def _id_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):  # as the float32 the code holds: 1e-06 -> 1em06, 0.125 -> 0p125
        return _f32_text(value).replace("-", "m").replace("+", "").replace(".", "p")
    if isinstance(value, str):
        return re.sub(r"[^A-Za-z0-9]", "", value)
    if isinstance(value, (list, tuple)):
        if len(value) <= _LIST_INLINE_MAX and all(isinstance(v, numbers.Integral) for v in value):
            return "x".join(str(int(v)) for v in value)
        blob = json.dumps([_id_value(v) for v in value]).encode()
        return f"{len(value)}x{hashlib.sha256(blob).hexdigest()[:10]}"
    raise CompileError(f"kernel parameter value {value!r} ({type(value).__name__}) has no id spelling")


def kernel_id(target: str, op: str, params: Mapping[str, Any]) -> str:
    """`cpu_gemm_n1536_k576_bf16_bias0`: target, op and every code-changing parameter (not `name`).

    Readable, a valid C identifier and file name; long lists (inv_freq) become length x short hash of
    their float32 values, e.g. `cpu_rope_qh9_d64_if32x1a2b3c4d5e`.
    """
    keys = [k for k in _ID_ORDER.get(op, []) if k in params]
    keys += sorted(k for k in params if k not in keys and k != "name")
    parts = [target, op] + [_ID_PREFIX.get(k, re.sub(r"[^A-Za-z0-9]", "", k)) + _id_value(params[k]) for k in keys]
    return "_".join(parts)


def _short(params: Mapping[str, Any]) -> str:
    """Parameters for an error message, long lists abbreviated."""
    items = []
    for k, v in params.items():
        long_list = isinstance(v, (list, tuple)) and len(v) > _LIST_INLINE_MAX
        items.append(f"{k}=[{len(v)} values]" if long_list else f"{k}={v!r}")
    return "{" + ", ".join(items) + "}"
