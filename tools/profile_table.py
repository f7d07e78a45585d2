"""`llmc profile`'s report as a table: one row a kernel against its floor, the step's total, and the notes that
say how to read it (tools/profile.py measures the report)."""

from __future__ import annotations


def _short(name: str, width: int) -> str:
    name = name.replace("llmc::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= width else name[: width - 1] + "…"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _weights_line(report: dict) -> list[str]:
    bits = report.get("quantized_bits_per_weight")
    read = f"a decode token reads {_mb(report['decode_weight_bytes'])} MB of weights (each once, one embedding row)"
    return (
        [f"quantization {report['quantization']}: its GEMM weights stored at {bits:.2f} bits a weight; {read}"]
        if bits
        else [read]
    )


def _format_measured(report: dict, shape: str) -> str:
    s, c = report["step"], report["ceilings"]
    on_gpu = report["mode"] == "gpu"
    clock = f"with CUDA events on {report['target']}" if on_gpu else "on the CPU"
    rates = f"{c['bf16_tensor_tflop_s']} bf16 TFLOP/s" + (
        "" if on_gpu else f", {c['fp32_tflop_s']} fp32, {c['int8_tops']} int8 TOP/s"
    )
    lines = [
        f"{report['artifact']}: {shape}, timed {clock} (median of {report['repeats']} steps; floors at {c['part']}: "
        f"{c['bandwidth_gb_s']} GB/s, {rates})",
        f"{'kernel':<52} {'launch':>6} {'floor MB':>9} {'GFLOP':>8} {'floor us':>9} {'time us':>9} {'floor/time':>10}",
    ]
    for k in sorted(report["kernels"], key=lambda k: -k["time_us"]):
        fraction = k["floor_us"] / k["time_us"] if k["time_us"] else 0.0
        lines.append(
            f"{_short(k['name'], 52):<52} {k['launches']:>6} {_mb(k['floor_bytes']):>9} "
            f"{k['flops'] / 1e9:>8.3f} {k['floor_us']:>9.2f} {k['time_us']:>9.2f} {100 * fraction:>9.1f}%"
        )
    lines.append(
        f"{'step (kernels)':<52} {s['launches']:>6} {_mb(s['floor_bytes']):>9} {s['flops'] / 1e9:>8.3f} "
        f"{s['floor_us']:>9.2f} {s['time_us']:>9.2f} {100 * s['floor_fraction']:>9.1f}%"
    )
    llc = report.get("host_llc_bytes") or 0
    if s["floor_bytes"] < llc:
        lines.append(
            f"the step's {_mb(s['floor_bytes'])} MB fit in this host's {llc >> 20} MiB last-level cache: its "
            "kernels read from the cache, which the DRAM floor does not bound"
        )
    lines.extend(_weights_line(report))
    lines.extend(_experts_line(s))
    served = "host copies; a CUDA graph at decode" if on_gpu else "the C ABI call from Python, logits out"
    lines.append(
        f"whole step as served ({served}): {s['wall_us']:.2f} us, {s['wall_us'] - s['time_us']:.2f} us of it "
        "outside the kernels; floors from the kernels' shapes (every input read once, every output written "
        "once)"
    )
    return "\n".join(lines)


def _experts_line(step: dict) -> list[str]:
    e = step.get("experts")
    if not e:
        return []
    per = e["per_layer"]
    return [
        f"experts: {sum(per) / len(per):.1f} of {e['of']} a layer activated (per layer {per}), "
        f"{_mb(e['weight_bytes'])} MB of their weights streamed once each"
    ]


def format_table(report: dict) -> str:
    """The report as a table: one row per kernel, then the step."""
    s = report["step"]
    shape = (
        f"decode batch {report['batch']} context {report['context']}"
        if report["phase"] == "decode"
        else f"prefill {report['prompt_len']} tokens"
    )
    if report["mode"] in ("gpu", "cpu"):
        return _format_measured(report, shape)
    c = report["ceilings"]
    lines = [
        f"{report['artifact']}: {shape}, simulated on {report['target']} ({report['part']}: "
        f"{c['bandwidth_gb_s']} GB/s, {c['bf16_tensor_tflop_s']} bf16 TFLOP/s, {c['launch_us']} us per launch)",
        f"{'kernel':<52} {'launch':>6} {'req MB':>9} {'DRAM MB':>9} {'floor MB':>9} {'DRAM/fl':>7} {'sect eff':>8} "
        f"{'bank/req':>8} {'mma':>9} {'GFLOP':>8} {'floor us':>9} {'time us':>9}",
    ]
    for k in sorted(report["kernels"], key=lambda k: -k["time_us"]):
        ratio = k["dram_bytes"] / k["floor_bytes"] if k["floor_bytes"] else 0.0
        lines.append(
            f"{_short(k['name'], 52):<52} {k['launches']:>6} {_mb(k['requested_bytes']):>9} {_mb(k['dram_bytes']):>9} "
            f"{_mb(k['floor_bytes']):>9} {ratio:>7.3f} {k['sector_efficiency']:>8.3f} "
            f"{k['bank_conflicts_per_request']:>8.3f} {k['tensor_core_instructions']:>9} {k['flops'] / 1e9:>8.3f} "
            f"{k['floor_us']:>9.2f} {k['time_us']:>9.2f}"
        )
    ratio = s["dram_bytes"] / s["floor_bytes"] if s["floor_bytes"] else 0.0
    lines.append(
        f"{'step':<52} {s['launches']:>6} {'':>9} {_mb(s['dram_bytes']):>9} {_mb(s['floor_bytes']):>9} {ratio:>7.3f} "
        f"{'':>8} {'':>8} {'':>9} {s['flops'] / 1e9:>8.3f} {s['floor_us']:>9.2f} {s['time_us']:>9.2f}"
    )
    lines.append(
        f"floor / predicted time: {100 * s['floor_fraction']:.1f}%; DRAM/fl = DRAM bytes / floor bytes; "
        "a kernel's FLOPs are its mma.sync ones, the step's the program's"
    )
    lines.append(
        f"the program's floor (its shapes' bytes, read and written once; experts as activated): "
        f"{_mb(s['program_floor_bytes'])} MB; DRAM / it = {s['dram_bytes'] / s['program_floor_bytes']:.3f}"
    )
    lines.extend(_weights_line(report))
    lines.extend(_experts_line(s))
    return "\n".join(lines)
