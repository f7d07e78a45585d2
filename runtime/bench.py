"""`llmc bench`: latency and throughput of a compiled model on a fixed synthetic workload, against the roofline.

The workload is the same on every run with the same arguments: prompts of `prompt_len` random token ids
from a seeded generator, greedy sampling, `ignore_eos`, so that every request generates exactly `output_len`
tokens. Each concurrency level runs `num_requests` requests through a fresh LLMEngine (the sync engine:
nothing but the engine's own work is timed), keeping `concurrency` of them in flight: when one finishes,
the next is added before the next step (a closed loop). A token's arrival time is the end of the step
that produced it.

Per level: TTFT (arrival -> first token) and TPOT ((last token - first token) / (output_len - 1)), p50 and
p99 over the requests; request throughput and output tokens/s over the level's wall time; and the prefix
cache's hit rate (prompt tokens found cached / prompt tokens looked up). With `shared_prefix` N, every prompt
starts with the same N tokens (a system prompt, say), so with prefix caching on all but the first requests of
a level find them cached. With speculative decoding on (the engine's), the guesses verified and accepted, and
the acceptance rate; a step then yields several tokens of a sequence, which arrive together.

Structured output (`structured`): every request's output is constrained by the same grammar (runtime/
structured.py), one that cannot end within output_len tokens, so the workload is the same length as without
it; each level also reports the time spent filling grammar masks per step (beside the model step).
`compare_structured` sets a structured run against the same workload unconstrained.

Roofline: decoding is memory-bound. Every step reads all the weights once (of the embedding table, a row a
token), whatever the batch size, so a sequence can never decode faster than memory_bandwidth / weight_bytes
tokens/s; a compiled model's weight_bytes is its artifact's decode_weight_bytes. The bandwidth is measured
in-process with a large numpy copy (host memory: right for the CPU target; pass `memory_bandwidth` for a
GPU) and `roofline_fraction` = roofline TPOT / measured TPOT p50. A mixture of experts reads a token's chosen
experts only (weight_bytes counts top_k of each layer's); a CPU module counts the experts its steps activate,
and each level reports them per layer and step, and the bytes of their weights per step.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

from llmc.errors import LlmcError
from llmc.runtime.engine import LLMEngine
from llmc.sampling_params import SamplingParams, StructuredOutputs

# `llmc bench --structured json`: records of mixed fields (numbers, strings, enums, arrays), more of them than
# any output_len holds, so that every request runs to max_tokens as an unconstrained one does
RECORDS_SCHEMA = {
    "type": "array",
    "minItems": 100_000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 24},
            "kind": {"enum": ["file", "directory", "link", "socket"]},
            "size": {"type": "number", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["id", "name", "kind", "size", "tags"],
    },
}
STRUCTURED_WORKLOADS = {"json": StructuredOutputs(json=RECORDS_SCHEMA)}


def make_workload(
    num_requests: int, prompt_len: int, vocab_size: int, seed: int, shared_prefix: int = 0
) -> list[list[int]]:
    """The synthetic prompts: `num_requests` lists of `prompt_len` token ids, a pure function of its arguments.

    The first `shared_prefix` tokens of every prompt are the same.
    """
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab_size, size=(num_requests, prompt_len))
    prompts[:, :shared_prefix] = prompts[0, :shared_prefix]
    return prompts.tolist()


def measure_memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Host memory bandwidth in bytes/s: the best of `repeats` copies of an `nbytes` array (read + write)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page first
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def _percentiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99])
    return float(p50), float(p99)


def _run_level(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    bar,
    structured: StructuredOutputs | None = None,
) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, structured=structured)
    counter = getattr(engine.model, "experts_activated", None)  # a module of a mixture of experts
    activated = counter() if counter else None
    steps = 0
    pending = collections.deque(range(len(prompts)))
    in_flight: dict[str, int] = {}
    added = [0.0] * len(prompts)
    token_times: list[list[float]] = [[] for _ in prompts]
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i = pending.popleft()
            in_flight[engine.add_request(prompts[i], params)] = i
            added[i] = time.perf_counter()
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise out.error
            i = in_flight[out.req_id]
            token_times[i].extend([now] * len(out.new_token_ids))
            if out.finished:
                del in_flight[out.req_id]
                bar.update(1)
    duration = time.perf_counter() - start

    lengths = {len(t) for t in token_times}
    if lengths != {output_len}:
        raise LlmcError(
            f"bench requests generated {sorted(lengths)} tokens, expected exactly {output_len}",
            "this is an engine bug: ignore_eos and max_tokens should fix the length",
        )
    ttft = [(t[0] - a) * 1e3 for t, a in zip(token_times, added, strict=True)]
    tpot = [(t[-1] - t[0]) * 1e3 / (len(t) - 1) for t in token_times if len(t) > 1]
    (ttft50, ttft99), (tpot50, tpot99) = _percentiles(ttft), _percentiles(tpot)
    stats = engine.stats()
    experts = {}
    layers = len(engine.model.config.moe_layers) if activated is not None else 0
    if layers:  # the (layer, expert) pairs the run's steps read, per step and layer
        per_layer = (counter() - activated) / steps / layers
        experts = {
            "experts_per_layer_step": per_layer,
            "expert_bytes_per_step": per_layer * layers * engine.model.artifact.expert_bytes,
        }
    return {
        **experts,
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "duration_s": duration,
        "ttft_p50_ms": ttft50,
        "ttft_p99_ms": ttft99,
        "tpot_p50_ms": tpot50,
        "tpot_p99_ms": tpot99,
        "request_throughput": len(prompts) / duration,
        "output_tokens_per_s": len(prompts) * output_len / duration,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "spec_draft_tokens": stats.spec_num_draft_tokens,
        "spec_accepted_tokens": stats.spec_num_accepted_tokens,
        "spec_acceptance_rate": stats.spec_acceptance_rate,
        "grammar_mask_ms_per_step": stats.grammar_mask_seconds * 1e3 / stats.grammar_mask_steps
        if stats.grammar_mask_steps
        else None,
    }


def run_bench(
    engine_factory: Callable[[], LLMEngine],
    *,
    concurrency: Sequence[int] = (1, 4, 16),
    num_requests: int | None = None,
    prompt_len: int = 128,
    output_len: int = 128,
    seed: int = 0,
    shared_prefix: int = 0,
    weight_bytes: int | None = None,
    memory_bandwidth: float | None = None,
    progress: bool = True,
    structured: StructuredOutputs | None = None,
) -> dict:
    """Run the workload at each concurrency level; returns a JSON-ready dict (see format_bench_table).

    engine_factory: makes a fresh LLMEngine over the model (called once for a warm-up and once per level),
    e.g. `lambda: LLMEngine(model)`. num_requests: per level; default max(4, 2 * concurrency). shared_prefix:
    how many leading tokens all prompts share (at most prompt_len). structured: every request's constraint
    (one that does not end within output_len tokens, such as STRUCTURED_WORKLOADS'); the engine needs a tokenizer.
    weight_bytes: bytes of weights one decode step reads (default: the model's `weight_bytes`, if it has
    one); with it the result has a roofline. memory_bandwidth: bytes/s; default measured here.
    """
    if prompt_len < 1 or output_len < 1 or any(c < 1 for c in concurrency):
        raise LlmcError("bench needs prompt_len, output_len and every concurrency level >= 1")
    if not 0 <= shared_prefix <= prompt_len:
        raise LlmcError(
            f"the shared prefix ({shared_prefix} tokens) must be within the prompt ({prompt_len} tokens)",
            "choose a shared prefix between 0 and the prompt length",
        )
    engine = engine_factory()
    if prompt_len + output_len > engine.max_model_len:
        raise LlmcError(
            f"prompt_len + output_len = {prompt_len + output_len} exceeds the model's max_model_len "
            f"({engine.max_model_len})",
            "choose a shorter workload",
        )
    if weight_bytes is None:
        weight_bytes = getattr(engine.model, "weight_bytes", None)
    counts = {c: num_requests or max(4, 2 * c) for c in concurrency}
    # warm-up (not timed): first-call costs (page faults on mmapped weights, lazy inits) stay out of the numbers
    engine.generate(
        [make_workload(1, prompt_len, engine.vocab_size, seed)[0]],
        SamplingParams(temperature=0.0, max_tokens=min(2, output_len), ignore_eos=True, structured=structured),
    )

    levels = []
    with tqdm(total=sum(counts.values()), desc="bench", unit="req", file=sys.stderr, disable=not progress) as bar:
        for c in concurrency:
            bar.set_postfix(concurrency=c)
            engine = engine_factory()
            prompts = make_workload(counts[c], prompt_len, engine.vocab_size, seed + c, shared_prefix)
            levels.append(_run_level(engine, prompts, output_len, c, bar, structured))
            levels[-1]["max_num_seqs"] = engine.scheduler.max_num_seqs

    roofline = None
    if weight_bytes:
        source = "given"
        if memory_bandwidth is None:
            memory_bandwidth, source = measure_memory_bandwidth(), "measured in-process: numpy copy, host memory"
        tokens_per_s = memory_bandwidth / weight_bytes
        roofline = {
            "weight_bytes_per_decode_step": int(weight_bytes),
            "memory_bandwidth_bytes_per_s": float(memory_bandwidth),
            "memory_bandwidth_source": source,
            "decode_tokens_per_s_per_seq": tokens_per_s,
            "tpot_ms": 1e3 / tokens_per_s,
        }
        for level in levels:
            tpot = level["tpot_p50_ms"]
            level["roofline_fraction"] = roofline["tpot_ms"] / tpot if tpot else None

    queries = sum(level["prefix_cache_queries"] for level in levels)
    speculative = None
    if engine.speculative is not None:
        drafted = sum(level["spec_draft_tokens"] for level in levels)
        speculative = {
            "method": engine.speculative.method,
            "num_speculative_tokens": engine.speculative.num_speculative_tokens,
            "acceptance_rate": sum(level["spec_accepted_tokens"] for level in levels) / drafted if drafted else 0.0,
        }
    return {
        "workload": {
            "prompt_len": prompt_len,
            "output_len": output_len,
            "seed": seed,
            "shared_prefix": shared_prefix,
            "sampling": "greedy, ignore_eos",
            "structured": None if structured is None else structured.kind,
        },
        "levels": levels,
        "roofline": roofline,
        "prefix_cache_hit_rate": sum(level["prefix_cache_hits"] for level in levels) / queries if queries else 0.0,
        "speculative": speculative,
    }


_COLUMNS = [  # header, key, format
    ("concurrency", "concurrency", "{:d}"),
    ("requests", "num_requests", "{:d}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.2f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.2f}"),
    ("TPOT p50 ms", "tpot_p50_ms", "{:.2f}"),
    ("TPOT p99 ms", "tpot_p99_ms", "{:.2f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("prefix hit", "prefix_cache_hit_rate", "{:.1%}"),
    ("% of roofline", "roofline_fraction", "{:.1%}"),
]
_SPEC_COLUMN = ("spec accept", "spec_acceptance_rate", "{:.1%}")  # shown when speculative decoding is on


def compare_structured(plain: dict, structured: dict) -> list[dict]:
    """Per concurrency level: the structured run's output tokens/s as a fraction of the unconstrained run's, and
    its mask time per step."""
    return [
        {
            "concurrency": p["concurrency"],
            "plain_tokens_per_s": p["output_tokens_per_s"],
            "structured_tokens_per_s": s["output_tokens_per_s"],
            "structured_fraction": s["output_tokens_per_s"] / p["output_tokens_per_s"],
            "grammar_mask_ms_per_step": s["grammar_mask_ms_per_step"],
        }
        for p, s in zip(plain["levels"], structured["levels"], strict=True)
    ]


def format_structured_comparison(rows: list[dict], kind: str) -> str:
    cells = [["concurrency", "plain tok/s", f"{kind} tok/s", f"{kind} / plain", "mask ms/step"]]
    for r in rows:
        mask = r["grammar_mask_ms_per_step"]
        cells.append(
            [
                str(r["concurrency"]),
                f"{r['plain_tokens_per_s']:.1f}",
                f"{r['structured_tokens_per_s']:.1f}",
                f"{r['structured_fraction']:.1%}",
                "-" if mask is None else f"{mask:.3f}",
            ]
        )
    return "\n".join([f"structured output ({kind}) against the same workload unconstrained:", *align_columns(cells)])


def align_columns(cells: list[list[str]], left: int = 0) -> list[str]:
    """Rows of text cells as aligned lines: the first `left` columns flush left, the rest flush right."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [
        "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]


def format_bench_table(result: dict) -> str:
    """The result as a plain-text table, with the workload above it and the roofline below."""
    w = result["workload"]
    shared = f" (the first {w['shared_prefix']} shared)" if w.get("shared_prefix") else ""
    lines = [
        f"workload: prompt {w['prompt_len']} tokens{shared}, output {w['output_len']} tokens "
        f"({w['sampling']}), seed {w['seed']}"
    ]
    spec = result.get("speculative")
    columns = _COLUMNS + [_SPEC_COLUMN] if spec else _COLUMNS
    cells = [[h for h, _, _ in columns]]
    for level in result["levels"]:
        row = []
        for _, key, fmt in columns:
            value = level.get(key)
            row.append("-" if value is None else fmt.format(value))
        cells.append(row)
    lines += align_columns(cells)
    for level in result["levels"]:
        if "experts_per_layer_step" in level:
            lines.append(
                f"experts at concurrency {level['concurrency']}: {level['experts_per_layer_step']:.1f} a layer per "
                f"step, {level['expert_bytes_per_step'] / 1e6:.1f} MB of their weights streamed per step"
            )
    roof = result.get("roofline")
    if roof:
        lines.append(
            f"roofline: {roof['weight_bytes_per_decode_step'] / 1e9:.3f} GB of weights per decode step, memory "
            f"bandwidth {roof['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({roof['memory_bandwidth_source']}) "
            f"-> at most {roof['decode_tokens_per_s_per_seq']:.1f} tokens/s per sequence (TPOT >= "
            f"{roof['tpot_ms']:.2f} ms); % of roofline = roofline TPOT / TPOT p50"
        )
    else:
        lines.append("roofline: not computed (the weight bytes per decode step are unknown)")
    if "prefix_cache_hit_rate" in result:
        lines.append(f"prefix cache hit rate: {result['prefix_cache_hit_rate']:.1%} of prompt tokens, all levels")
    if spec:
        lines.append(
            f"speculative decoding: {spec['method']}, {spec['num_speculative_tokens']} tokens per step; "
            f"{spec['acceptance_rate']:.1%} of guesses accepted, all levels"
        )
    return "\n".join(lines)
