"""The kernel program as the manifest holds it: a JSON object, its schema, its printed form, and what it reads.

The compiler writes it (compiler/program.py: KernelProgram.to_json) and anyone reads it from an artifact's
manifest (`kernel_program`) without the compiler: `llmc inspect`, the memory roofline's bytes
(`decode_weight_bytes`), the benchmarks. Schema 1:

    {"schema": 1,
     "kv_dtype": "float32",  "act_dtype": "float32",        the KV cache and activation elements
     "buffers":  [{"rows": "T" | "N", "cols": 64}, ...],    buf<i>: rows x cols of act_dtype
     "weights":  [{"name": ..., "dtype": "bfloat16", "shape": [N, K] (as stored), "quant": "int4 g32" | null,
                   "interleave": 0, "sources": [checkpoint tensor names],
                   "affine": [scale, offset] (only where the values are source * scale + offset)}, ...],  W[i]
     "launches": [{"op": "gemm", "params": {...}, "args": ["buf0", "W[3]", ...], "fused": ["q+k+v_proj"]}, ...],
     "tvm_funcs": {"tvm_nn_silu_0": "<TVMScript of the fallback>", ...}}

A launch's args are C expressions (compiler/program.py's docstring); a weight is named by the whole argument
`W[i]`. `format_program` prints it, one line per buffer, weight and launch; KernelProgram's str() is that
print of its to_json(), so the two cannot drift.
"""

from __future__ import annotations

import math

from llmc.dtypes import DTYPES, ELEMENT_DTYPES, KV_DTYPES

SCHEMA = 1
_KEYS = {"schema", "kv_dtype", "act_dtype", "buffers", "weights", "launches", "tvm_funcs"}
_BUFFER_KEYS = {"rows", "cols"}
_WEIGHT_KEYS = {"name", "dtype", "shape", "quant", "interleave", "sources"}
_LAUNCH_KEYS = {"op", "params", "args", "fused"}
_UNPRINTED_PARAMS = ("inv_freq",)  # RoPE's frequencies: in the JSON, too long a line to print
EXPERT_GEMMS = ("moe_gemm", "moe_qgemm")  # the ops whose weights stack every expert of a layer


def weight_ref(arg: str) -> int | None:
    """The index i of a launch argument `W[i]` (a packed weight), None for any other argument."""
    if arg.startswith("W[") and arg.endswith("]") and arg[2:-1].isdigit():
        return int(arg[2:-1])
    return None


def format_program(program: dict) -> str:
    """The printed kernel program: a header line, then each buffer, weight, launch and TVM fallback."""
    buffers, weights, launches = program["buffers"], program["weights"], program["launches"]
    act_dtype = program["act_dtype"]
    lines = [
        f"kernel program: {len(launches)} launches, {len(buffers)} buffers, "
        f"{len(weights)} packed weights, {program['kv_dtype']} KV cache, {act_dtype} activations"
    ]
    for i, b in enumerate(buffers):
        lines.append(f"  buf{i}: {act_dtype}[{b['rows']}, {b['cols']}]")
    for i, w in enumerate(weights):
        quant = f" ({w['quant']})" if w["quant"] is not None else ""
        rows = f" (rows interleaved {w['interleave']} at a time)" if w["interleave"] else ""
        affine = f" * {w['affine'][0]:g} + {w['affine'][1]:g}" if "affine" in w else ""
        lines.append(
            f"  W[{i}] {w['name']}: {w['dtype']}{w['shape']}{quant}{rows} <- {', '.join(w['sources'])}{affine}"
        )
    for launch in launches:
        params = ", ".join(f"{k}={v}" for k, v in launch["params"].items() if k not in _UNPRINTED_PARAMS)
        lines.append(f"  {launch['op']}({params})({', '.join(launch['args'])})  # {' + '.join(launch['fused'])}")
    for name, script in program["tvm_funcs"].items():
        lines.append(f"  TVM fallback {name}:")
        lines += ["    " + line for line in script.splitlines()]
    return "\n".join(lines)


def decode_weight_bytes(program: dict) -> dict[str, int]:
    """Bytes of weights one decode step of one token reads, by op: each weight a launch names, in full, except
    an embedding's table (or a quantized one's parts), of which it reads one row, and stacked experts, of which
    it reads the top_k the token chose. What a step streams at batch 1, and so the memory roofline's bytes."""
    by_op: dict[str, int] = {}
    for launch in program["launches"]:
        op = launch["op"]
        for arg in launch["args"]:
            i = weight_ref(arg)
            if i is None:
                continue
            w = program["weights"][i]
            elements = math.prod(w["shape"][-1:] if op in ("embedding", "qembedding") else w["shape"])  # a row
            if op in EXPERT_GEMMS:
                elements = elements * launch["params"]["top_k"] // launch["params"]["experts"]
            by_op[op] = by_op.get(op, 0) + DTYPES[w["dtype"]].nbytes * elements
    return by_op


def expert_bytes(program: dict) -> int:
    """Bytes of one expert's weights in one mixture-of-experts layer (its gate/up and down, the layers' mean): what
    a step streams for each (layer, expert) it activates; 0 without experts."""
    total, layers, experts = 0, 0, 1
    for launch in program["launches"]:
        if launch["op"] not in EXPERT_GEMMS:
            continue
        experts = launch["params"]["experts"]
        layers += bool(launch["params"]["swiglu"])
        for arg in launch["args"]:
            i = weight_ref(arg)
            if i is not None:
                w = program["weights"][i]
                total += DTYPES[w["dtype"]].nbytes * math.prod(w["shape"])
    return total // (experts * layers) if layers else 0


def schema_problem(program) -> str | None:
    """What makes `program` (parsed JSON, untrusted) not a kernel program of SCHEMA, in a few words; None when
    it is one: every field of its type, each weight a launch names declared."""
    if not isinstance(program, dict):
        return "is not an object"
    if program.get("schema") != SCHEMA or type(program.get("schema")) is not int:
        return f"has schema {_short(program.get('schema'))}; this llmc reads schema {SCHEMA}"
    if set(program) != _KEYS:
        return f"has fields {_names(program)}, not {', '.join(sorted(_KEYS))}"
    for key, allowed in (("kv_dtype", KV_DTYPES), ("act_dtype", ELEMENT_DTYPES)):
        if program[key] not in allowed:
            return f"{key} {_short(program[key])} is not one of {', '.join(allowed)}"
    for key in ("buffers", "weights", "launches"):
        if not isinstance(program[key], list):
            return f"{key} is not a list"
    for i, b in enumerate(program["buffers"]):
        if not (isinstance(b, dict) and set(b) == _BUFFER_KEYS and b["rows"] in ("T", "N") and _count(b["cols"], 1)):
            return f"buffer {i} is not {{rows: T | N, cols: a positive integer}}"
    for i, w in enumerate(program["weights"]):
        if not (isinstance(w, dict) and set(w) - {"affine"} == _WEIGHT_KEYS):
            return f"weight {i} does not have the fields {', '.join(sorted(_WEIGHT_KEYS))}"
        if not (
            isinstance(w["name"], str)
            and isinstance(w["dtype"], str)
            and w["dtype"] in DTYPES
            and isinstance(w["quant"], str | None)
            and isinstance(w["shape"], list)
            and len(w["shape"]) <= 8
            and all(_count(d) for d in w["shape"])
            and _count(w["interleave"])
            and _strings(w["sources"])
            and _affine(w.get("affine", [1.0, 0.0]))
        ):
            return f"weight {i} ({_short(w['name'])}) has a field of the wrong type"
    for i, launch in enumerate(program["launches"]):
        if not (
            isinstance(launch, dict)
            and set(launch) == _LAUNCH_KEYS
            and isinstance(launch["op"], str)
            and isinstance(launch["params"], dict)
            and _strings(launch["args"])
            and _strings(launch["fused"])
        ):
            return f"launch {i} is not {{op, params, args, fused}} of their types"
        refs = [r for r in map(weight_ref, launch["args"]) if r is not None]
        if any(r >= len(program["weights"]) for r in refs):
            return f"launch {i} ({_short(launch['op'])}) names a weight that is not declared"
    funcs = program["tvm_funcs"]
    if not (isinstance(funcs, dict) and all(isinstance(v, str) for v in funcs.values())):
        return "tvm_funcs is not an object of script texts"
    return None


def _count(value, low: int = 0) -> bool:
    return type(value) is int and low <= value < 2**63  # bool is no count here


def _affine(value) -> bool:
    return (
        isinstance(value, list) and len(value) == 2 and all(type(v) in (int, float) and math.isfinite(v) for v in value)
    )


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _names(d: dict) -> str:
    return ", ".join(_short(k, 20) for k in sorted(d)[:8])
