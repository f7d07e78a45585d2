"""Pieces the CPU benchmarks share: model shapes, random checkpoints, cached builds, the weight bytes a decode
step reads, memory bandwidth, the machine's description, and llmc's batch-1 step loop.

Checkpoints and artifacts live under the benchmark cache dir ($LLMC_CACHE_DIR/bench, or ~/.cache/llmc/bench).
A checkpoint is written once per shape; an artifact once per (shape, weight dtype, compile options, llmc
source state), keyed by a hash of compiler/ and templates/cpu/, and older builds of the same key are removed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llmc.compiler.codegen.host_probes import Bandwidth  # noqa: F401 (the benchmarks' probe)
from llmc.host import host_caches

REPO = Path(__file__).resolve().parent.parent

# A family's transformers config class and architecture name (random_checkpoint)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# A family's fields beyond a Llama config's kwargs, as its real checkpoints set them (Gemma 3 1B: a window of 512
# on 5 layers of 6, the softmax scale of head_dim; Gemma 2: a window on every other layer, its soft-capping of 50
# and 30 by default; Granite 3.x: its multipliers)
FAMILY_FIELDS = {
    "gemma3": {"sliding_window": 512, "query_pre_attn_scalar": 64},
    "gemma2": {"sliding_window": 512, "query_pre_attn_scalar": 64},
    "granite": {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625,
        "logits_scaling": 8.0,
    },
}

SMOLLM_135M = {  # LlamaConfig kwargs
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# Llama-3.2-1B's shape. Plain RoPE: the real model's llama3 rope scaling changes no byte a step reads, and
# only positions past its original 8192-token context.
LLAMA_32_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


# Qwen3-30B-A3B's shape, 4 of its 48 layers: 128 experts of 768, 8 a token, renormalized; q/k norms, head_dim 128,
# untied. 3.0 G parameters (2.4 G of them experts), of which a token reads 0.35 G (8 experts a layer, the head).
QWEN3_30B_A3B_4L = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def decode_gemv_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """(label, n, k) of one decode step's GEMVs for a LlamaConfig shape: fused qkv, o, fused gate_up, down,
    lm_head."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    qkv = h + 2 * cfg["num_key_value_heads"] * d
    return [("qkv", qkv, h), ("o", h, h), ("gate_up", 2 * i, h), ("down", h, i), ("lm_head", cfg["vocab_size"], h)]


# The tokenizer every benchmark checkpoint ships (tests/checkpoints.train_tokenizer): prompts use ids below it.
TOKENIZER_VOCAB = 384


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def set_threads(n: int) -> None:
    """Before any OpenMP runtime loads (llmc's modules, torch, the bandwidth probe): n threads."""
    os.environ["OMP_NUM_THREADS"] = str(n)


def cache_dir(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    root = os.environ.get("LLMC_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "llmc") / "bench"


# -- checkpoints and artifacts ------------------------------------------------------------------------


def random_checkpoint(
    out: Path,
    config: dict,
    log=log,
    gain: float = 2.0,
    embed_std: float = 0.02,
    seed: int = 0,
    family: str = "llama",
) -> Path:
    """A checkpoint of the config's shape in `family` (FAMILIES: its transformers config class) with random fp32
    weights, written tensor by tensor (a shard of at most 1 GiB in memory at a time), plus the small byte-level
    BPE tokenizer.

    Norms are 1 and the embedding N(0, embed_std), as transformers initialises them; the other matrices are
    N(0, (gain / sqrt(fan_in))^2). transformers' std 0.02 for those collapses greedy decode onto one repeated
    token (on the SmolLM-135M shape: 1 distinct token in 64), a step no real model takes; gain 2 gives 64 distinct
    tokens in 64. Every matrix is written fp32. out appears once complete."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import numpy as np
    import transformers
    from safetensors.numpy import save_file

    sys.path.insert(0, str(REPO / "tests"))
    from checkpoints import train_tokenizer

    from llmc.compiler.frontend.config import parse_config

    log(f"writing a random checkpoint ({config['hidden_size']} hidden, {config['num_hidden_layers']} layers) to {out}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    train_tokenizer(tmp)
    config_class, architecture = FAMILIES[family]
    hf_config = getattr(transformers, config_class)(**config, **FAMILY_FIELDS.get(family, {}))
    hf_config.architectures = [architecture]
    hf_config.save_pretrained(tmp)
    shapes = parse_config(hf_config.to_dict()).weight_shapes()
    rng = np.random.default_rng(seed)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        n += 1
        fname = f"model-{n:05d}.safetensors"
        save_file(shard, str(tmp / fname))
        weight_map.update(dict.fromkeys(shard, fname))
        shard, size = {}, 0

    for name, shape in shapes.items():
        nbytes = 4 * math.prod(shape)
        if shard and size + nbytes > 1 << 30:
            flush()
        if len(shape) == 1:
            shard[name] = np.ones(shape, np.float32)
        else:
            std = embed_std if name == "model.embed_tokens.weight" else gain / math.sqrt(shape[-1])
            shard[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        size += nbytes
    flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def source_hash() -> str:
    """What an artifact depends on besides the checkpoint: the compiler, the CPU templates, the tuning database."""
    h = hashlib.sha256()
    for root in (REPO / "compiler", REPO / "templates" / "cpu", REPO / "targets"):
        for f in sorted(root.rglob("*")):
            if f.is_file() and f.suffix in (".py", ".j2", ".h", ".toml", ".json"):
                h.update(str(f.relative_to(REPO)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compiled(ckpt: Path, cache: Path, tag: str, dtype: str, log=log, **options) -> Path:
    """The CPU artifact of ckpt at weight dtype (plus any other compile_checkpoint options), built once per
    llmc source state under cache/<tag>-<dtype>[+<options digest>]-<source hash>.cpu."""
    from llmc.compiler.compile import compile_checkpoint

    key = f"{tag}-{dtype}"
    if options:
        key += "+" + hashlib.sha256(repr(sorted(options.items())).encode()).hexdigest()[:8]
    out = cache / f"{key}-{source_hash()}.cpu"
    if (out / "manifest.json").is_file():
        return out
    for old in cache.glob(f"{key}-*.cpu"):  # stale builds of older sources: up to GBs each
        shutil.rmtree(old, ignore_errors=True)
    log(f"compiling ({dtype}{', ' + repr(options) if options else ''}) -> {out}")
    t = time.perf_counter()
    compile_checkpoint(ckpt, target="cpu", output=out, weight_dtype=dtype, progress=True, **options)
    log(f"  compiled in {time.perf_counter() - t:.1f} s")
    return out


# -- the machine --------------------------------------------------------------------------------------


def machine() -> dict:
    """CPU model, logical cores, caches of cpu0 and the vector ISA extensions the kernels may use."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni") if f in flags]
    return {"cpu": model, "cores": os.cpu_count(), "caches": host_caches(), "isa": isa}


def describe_machine(m: dict) -> str:
    caches = ", ".join(
        f"L{c['level']}{'d' if c['type'] == 'Data' else 'i' if c['type'] == 'Instruction' else ''} "
        f"{c['bytes'] >> 10} KiB"
        if c["bytes"] < 1 << 20
        else f"L{c['level']} {c['bytes'] >> 20} MiB"
        for c in m["caches"]
    )
    return f"{m['cpu']}, {m['cores']} logical cores; {caches}; {' '.join(m['isa']) or 'no AVX2'}"


# -- llmc's batch-1 step ------------------------------------------------------------------------------


class LlmcStep:
    """CompiledModel.step at batch 1: prefill, then greedy decode through the C ABI."""

    def __init__(self, path: Path, max_len: int):
        from llmc.runtime.kv_cache import KVCacheManager
        from llmc.runtime.module import CompiledModel

        self.model = CompiledModel.load(
            path, kv_cache_memory=256 << 20, max_num_tokens=max(256, max_len), max_num_seqs=4
        )
        self.kv_cache = KVCacheManager(self.model.num_blocks, self.model.block_size)  # the runtime's blocks
        self.max_len = max_len

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        """Prefill the prompt, then n greedy decode steps: (seconds of the prefill, seconds of the n steps,
        the n + 1 tokens)."""
        import numpy as np

        from llmc.runtime.batch import StepBatch

        assert len(prompt) + n <= self.max_len
        if "bench" in self.kv_cache:
            self.kv_cache.free("bench")
        assert self.kv_cache.allocate_slots("bench", len(prompt) + n), "the cache was sized for max_len"
        blocks, bs = self.kv_cache.block_ids("bench"), self.model.block_size
        t = time.perf_counter()
        logits = self.model.step(StepBatch.build([prompt], [0], [blocks], bs))
        tok = int(np.argmax(logits[0]))
        prefill = time.perf_counter() - t
        out = [tok]
        pos = len(prompt)
        t = time.perf_counter()
        for _ in range(n):
            logits = self.model.step(StepBatch.build([[tok]], [pos], [blocks], bs))
            tok = int(np.argmax(logits[0]))
            out.append(tok)
            pos += 1
        return prefill, time.perf_counter() - t, out

    def generate(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        """Prefill the prompt (untimed), then n greedy decode steps: (seconds of the n steps, the n + 1 tokens)."""
        _, sec, out = self.run(prompt, n)
        return sec, out


def headers_at(rev: str | None) -> dict[str, str]:
    """The CPU target's headers (templates/cpu/include) as they are, or at git revision `rev`."""
    from llmc.compiler.codegen.render import target_headers

    if rev is None:
        return target_headers("cpu")
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "templates/cpu/include/"], cwd=REPO, check=True, capture_output=True
    ).stdout.split()
    show = ["git", "show"]
    return {
        Path(n.decode()).name: subprocess.run(
            [*show, f"{rev}:{n.decode()}"], cwd=REPO, check=True, capture_output=True
        ).stdout.decode()
        for n in names
    }


def settle_pools() -> None:
    """Wait until every loaded build's pool workers have stopped spinning (llmc_pool.h: kPoolSpinUs, 300 us, after
    a build's last launch). Each build of an A/B (--baseline) has its own pool: timed while the other's workers
    still spin, a build shares a 2-core machine's cores with them (the same header text, timed against itself
    that way, read 2.2x slower as the second build)."""
    time.sleep(0.002)


def ab_header(head: list[str], names: list[str], cols: list[str]) -> list[str]:
    """A kernel table's header: head, then "<build> us" and cols for each build, then the first's speed-up over
    the second (--baseline)."""
    for name in names:
        head = [*head, f"{name} us", *cols]
    return head + ([f"speed-up vs {names[1]}"] if len(names) > 1 else [])


def ab_cells(times: dict[str, list[float]], nbytes: float, work: float, floor: float) -> list[str]:
    """One case's cells under ab_header: per build, its median time in us, then bytes, work (flops or MACs) and
    floor seconds over it (GB/s, G/s, % of the roof); then the speed-up."""
    meds = {name: statistics.median(ts) for name, ts in times.items()}
    out = []
    for t in meds.values():
        out += [f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.1f}", f"{work / t / 1e9:.1f}", f"{100 * floor / t:.0f}%"]
    names = list(meds)
    return out + ([f"{meds[names[1]] / meds[names[0]]:.2f}x"] if len(names) > 1 else [])
