"""What `llmc inspect` prints: a checkpoint's architecture, size and memory; the passes and kernel program compile
would make of it; and a compiled artifact's manifest (target, weights, quantization and its quality, buffer
plan, passes, kernels, tuning)."""

from __future__ import annotations

from pathlib import Path

import click

from llmc.kernel_program import format_program
from llmc.manifest import quant_bits_per_weight

from .options import config_text


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def inspect_checkpoint(model: Path, ckpt) -> None:
    """A loaded checkpoint (load_checkpoint's): architecture, parameters, shapes, weights and their memory."""
    c = ckpt.config
    n = c.num_parameters()
    dtypes = sorted(set(ckpt.dtypes.values()))
    click.echo(f"{model}: {c.architecture}")
    click.echo(f"  parameters     {n:,} ({n / 1e6:.1f}M)")
    click.echo(f"  layers         {c.num_layers}, hidden {c.hidden_size}, intermediate {c.intermediate_size}")
    window = (
        f"; sliding window {c.sliding_window} in {len(c.sliding_layers)} of {c.num_layers} layers"
        if c.sliding_window
        else ""
    )
    click.echo(f"  heads          {c.num_heads} query, {c.num_kv_heads} kv, head_dim {c.head_dim}{window}")
    click.echo(f"  vocab          {c.vocab_size}{', tied embeddings' if c.tie_word_embeddings else ''}")
    rope = c.rope_scaling["rope_type"] if c.rope_scaling else "default"
    click.echo(f"  rope           theta {c.rope_theta:g}, {rope}; context {c.max_context}")
    click.echo(f"  weight dtypes  {', '.join(dtypes)} in {len(ckpt.files())} file(s)")
    click.echo(
        "  weight memory  "
        + ", ".join(
            f"{name} {human_bytes(n * width)}"
            for name, width in (("fp32", 4), ("bf16/fp16", 2), ("int8", 1), ("int4", 0.5))
        )
    )
    kv_per_token = 2 * c.num_layers * c.kv_size
    click.echo(
        f"  kv cache       {human_bytes(kv_per_token * 4)}/token at fp32, {human_bytes(kv_per_token * 2)}/token at bf16"
    )


def inspect_passes(ckpt, quant) -> None:
    """Trace the checkpoint, run each pass (reporting what it rewrote), and print the kernel program."""
    from llmc.compiler.compile import build_program, quant_schemes, resolve_weight_dtype
    from llmc.compiler.passes.common import rewrite_counts
    from llmc.targets import load_target

    def report(name, mod):
        count = rewrite_counts(mod)[name]
        click.echo(f"    {name:<22} {f'{count} rewrites' if count else 'no pattern found: module unchanged'}")

    click.echo("  passes")
    # The kernel program is the same for every target but for the KV block size: show the CPU target's.
    program = build_program(
        ckpt,
        resolve_weight_dtype(ckpt, "auto"),
        load_target("cpu").block_size,
        after_each_pass=report,
        schemes=quant_schemes(ckpt, quant),
    )
    print_kernel_program(program)


def print_kernel_program(program) -> None:
    """A kernel program (the compiler's KernelProgram, or the text llmc.kernel_program prints from a manifest's),
    indented."""
    click.echo("\n".join("  " + line for line in str(program).splitlines()))


def inspect_artifact(path: Path, verbose: bool) -> None:
    """A compiled artifact, from its manifest: verbose lists every kernel, quantized weight and tuned kernel."""
    from llmc.artifact import load_artifact, safetensors_data_bytes

    a = load_artifact(path, check_target=False)  # verified: what it describes is what `llmc run` would load
    m, c = a.manifest, a.config
    target = dict(a.target)
    name = target.pop("name")
    isa = target.pop("isa", None)
    click.echo(
        f"{path}: llmc artifact for {name}, compiled by llmc {m.get('compiler_version')} "
        f"(format {m.get('format_version')}, ABI {m.get('abi_version')})"
    )
    click.echo(
        f"  model          {c.architecture}, {c.num_parameters() / 1e6:.1f}M parameters, {c.num_layers} layers, "
        f"context {c.max_context}"
    )
    for key in ("gencode", "flags", "machine"):  # what the module was built with; the rest is in the manifest
        if key in target:
            value = target[key]
            click.echo(f"  target {key:<8}{' '.join(map(str, value)) if isinstance(value, list) else value}")
    if isa:
        simd = [f for f in isa if f.startswith(("avx", "amx", "sve", "asimd", "fma", "f16c"))]
        click.echo(f"  target isa     {' '.join(simd or isa)}")
    weights = path / "weights.safetensors"
    size = human_bytes(safetensors_data_bytes(weights)) if weights.is_file() else "missing"
    click.echo(f"  weights        {m.get('weight_dtype')}, {size}; quantization {m.get('quantization', 'none')}")
    click.echo(f"  KV cache       {a.kv_dtype}, blocks of {a.block_size} tokens")
    click.echo(f"  activations    {m.get('activation_dtype', 'float32')}")  # absent: an artifact from before the field
    quant = m.get("quant")
    if isinstance(quant, dict):
        _inspect_quant(quant, verbose)
    quality = m.get("quality")
    if isinstance(quality, dict):
        from llmc.tools.quality import describe  # numpy only

        click.echo(f"  quality        {describe(quality)}")
    plan = m.get("buffer_plan") or {}
    parts = []
    for key, value in plan.items():
        if isinstance(value, (list, tuple, dict)):
            value = len(value)
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        shown = human_bytes(value) if key.endswith("bytes") and isinstance(value, int) else value
        parts.append(f"{key.removesuffix('_bytes')} {shown}")
    click.echo(f"  buffer plan    {', '.join(parts) if parts else '(none recorded)'}")
    passes = m.get("passes") or {}
    click.echo("  passes" + ("         (none recorded)" if not passes else ""))
    for pname, n in passes.items():
        click.echo(f"    {pname:<22} {'no pattern found' if not n else f'{n} rewrite' + ('s' if n != 1 else '')}")
    kernels = m.get("kernels") or []
    click.echo(f"  kernels        {len(kernels)}")
    _inspect_tuning(m.get("tuning"), verbose)
    fallback = sorted(
        {op for k in kernels if str(k.get("template")).endswith("/tvm_call") for op in k.get("fuses", [])}
    )
    click.echo(f"  TVM fallback   {', '.join(fallback) if fallback else 'none (every op has a kernel template)'}")
    _inspect_kernels(kernels, verbose)
    if verbose and m.get("kernel_program") is not None:  # load_artifact checked its schema
        print_kernel_program(format_program(m["kernel_program"]))


def _inspect_kernels(kernels: list[dict], verbose: bool) -> None:
    """The manifest's kernels: each with its parameters (verbose), else grouped by template and fused ops."""
    if verbose:
        for k in kernels:
            fused = _fused(k)
            click.echo(
                f"    {k.get('id')}: {k.get('template')} x{k.get('launches', 1)} [{k.get('tuning_source', '')}] "
                f"{_params(k)}{'; fuses ' + fused if fused else ''}"
            )
        return
    groups: dict[tuple[str, str], list[dict]] = {}
    for k in kernels:
        groups.setdefault((str(k.get("template")), _fused(k)), []).append(k)
    for (template, fused), ks in groups.items():
        launches = sum(int(k.get("launches", 1)) for k in ks)
        sources = sorted({str(k.get("tuning_source")) for k in ks if k.get("tuning_source")})
        click.echo(
            f"    {template:<22} {len(ks)} kernel{'s' if len(ks) != 1 else ' '} {launches:>3} launch"
            f"{'es' if launches != 1 else '  '}  {'fuses ' + fused if fused else '':<28}"
            f"{' tuning: ' + ', '.join(sources) if sources else ''}".rstrip()
        )
    if kernels:
        click.echo("    (-v lists every kernel with its parameters)")


def _inspect_quant(quant: dict, verbose: bool) -> None:
    """The manifest's `quant` entry: the build's scheme, the activations, packed bytes and each GEMM's scheme."""
    weights = quant.get("weights") if isinstance(quant.get("weights"), dict) else {}
    packed = quant.get("packed_bytes") if isinstance(quant.get("packed_bytes"), dict) else {}
    bits = quant_bits_per_weight(quant)
    sizes = ", ".join(
        f"{k} {human_bytes(v)}" + (f" ({bits:.2f} bits a weight)" if k == "quantized" and bits else "")
        for k, v in packed.items()
        if isinstance(v, int)
    )
    weighted = quant.get("importance_tokens")
    click.echo(
        f"  quant          {quant.get('default')}; activations {quant.get('activations')}"
        f"{'; ' + sizes if sizes else ''}"
        f"{f'; rounding weighted by activations over {weighted} tokens' if isinstance(weighted, int) else ''}"
    )
    counts: dict[str, int] = {}
    for scheme in weights.values():
        counts[str(scheme)] = counts.get(str(scheme), 0) + 1
    click.echo(f"  quantized      {', '.join(f'{n} GEMM weights {s}' for s, n in counts.items()) or 'none'}")
    if verbose:
        for name, scheme in weights.items():
            click.echo(f"    {name}: {scheme}")


def _inspect_tuning(tuning: dict | None, verbose: bool) -> None:
    """Which tunable kernels took their parameters from the tuning database, which the template's defaults."""
    kernels = (tuning or {}).get("kernels") or {}
    if not kernels:
        click.echo("  tuning         none (no kernel has tunable parameters)")
        return
    by_source: dict[str, int] = {}
    for k in kernels.values():
        by_source[str(k.get("source"))] = by_source.get(str(k.get("source")), 0) + 1
    counts = ", ".join(f"{n} {src}" for src, n in sorted(by_source.items()))
    click.echo(
        f"  tuning         {counts} (of {len(kernels)} tunable kernels; default: no entry for this shape"
        f"{' and ISA' if any('ignored' in k for k in kernels.values()) else ''}); db {tuning.get('database')}"
    )
    if verbose:
        for kid, k in kernels.items():
            ignored = "; ignored: " + ", ".join(k["ignored"]) if k.get("ignored") else ""
            click.echo(f"    {kid}: {k.get('source')} {config_text(k.get('params') or {})}{ignored}")


def _fused(kernel: dict) -> str:
    return " + ".join(map(str, kernel.get("fuses") or []))


def _params(kernel: dict) -> str:
    params = kernel.get("params") or {}
    return ", ".join(f"{k}={v}" for k, v in params.items() if not (isinstance(v, list) and len(v) > 8))
