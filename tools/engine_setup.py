"""From a model path and the serving flags to engines: what `llmc run`, `llmc serve`, `llmc bench` and a Ray Serve
replica share. An artifact is resolved (a checkpoint or .gguf is compiled on demand, through the compile cache),
loaded (under the CUDA simulator with simulate=True), with a draft model for speculative decoding, and wrapped
in engines or an HTTP app. Everything the runtime or the compiler needs is imported inside the function that
needs it: loading an artifact loads no compiler.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from llmc import examples
from llmc.errors import LlmcError


def resolve_artifact(path: Path | None, quant=None, kv_cache_dtype: str = "auto") -> Path:
    """The artifact for `path`: None is the bundled model, and a checkpoint dir or .gguf file is compiled for this
    CPU once and cached. quant: the QuantConfig a checkpoint is compiled with (--quant), kv_cache_dtype its KV
    cache's (--kv-cache-dtype); an artifact is compiled already."""
    from llmc.tools.build import cached_artifact

    if path is None:
        return cached_artifact(examples.bundled_checkpoint(), quant=quant, kv_dtype=kv_cache_dtype)
    if path.is_dir() and not (path / "manifest.json").exists() and (path / "config.json").is_file():
        return cached_artifact(path, quant=quant, kv_dtype=kv_cache_dtype)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return cached_artifact(path, quant=quant, kv_dtype=kv_cache_dtype)
    if quant is not None and quant.enabled:
        raise LlmcError(
            f"--quant applies when a checkpoint is compiled, and {path} is not a checkpoint dir",
            "pass the checkpoint, or compile it with llmc compile --quant",
        )
    if kv_cache_dtype != "auto":
        raise LlmcError(
            f"--kv-cache-dtype applies when a checkpoint is compiled, and {path} is not a checkpoint",
            "pass the checkpoint, or compile it with llmc compile --kv-cache-dtype",
        )
    return path  # an artifact, or load_artifact says what is wrong with it


def load_model(path: Path, kv_cache_memory: str | None, simulate: bool = False, **kw):
    """The CompiledModel at `path` (kw: CompiledModel.load's) and its tokenizer; simulate: under the CUDA simulator."""
    from llmc.runtime.module import CompiledModel, load_tokenizer

    if simulate:  # the compiler builds the simulated module; the runtime only loads a library
        from llmc.compiler.codegen.simulator import build_simulated_library

        kw["library"] = build_simulated_library(path)
    model = CompiledModel.load(path, kv_cache_memory=kv_cache_memory, **kw)
    return model, load_tokenizer(model.tokenizer_path)


def speculative_config(
    method: str | None,
    num_tokens: int,
    draft: Path | None,
    tokenizer,
    kv_cache_memory: str | None,
    max_num_seqs: int,
    stack: contextlib.ExitStack,
):
    """The engine's SpeculativeConfig for the flags (None: off). A draft model is loaded, and closed by `stack`."""
    from llmc.runtime.spec_decode import SpeculativeConfig

    if (method == "draft") != (draft is not None):
        raise LlmcError(
            "--draft goes with --speculative draft, and --speculative draft needs it",
            "pass both: --speculative draft --draft ARTIFACT",
        )
    if method is None:
        return None
    draft_model = None
    if draft is not None:
        draft_model, draft_tokenizer = load_model(resolve_artifact(draft), kv_cache_memory, max_num_seqs=max_num_seqs)
        stack.callback(draft_model.close)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise LlmcError(
                f"the draft model {draft} has another tokenizer than the target",
                "use a draft trained with the target's tokenizer (examples/train_tiny.py makes one)",
            )
    return SpeculativeConfig(method, num_tokens, draft_model)


def logits_rows(method: str | None, num_tokens: int, max_num_seqs: int) -> int | None:
    """max_num_logits for CompiledModel.load: room for every sequence's guesses (None: the default, one each)."""
    return None if method is None else max_num_seqs * (num_tokens + 1)


def engine_parts(
    stack: contextlib.ExitStack,
    path: Path,
    kv_cache_memory: str | None,
    max_num_seqs: int,
    no_prefix_caching: bool,
    speculative: str | None,
    num_speculative_tokens: int,
    draft: Path | None,
    **load_kw,
):
    """What run, serve and bench share: the model (and a draft) loaded for their flags and closed by `stack`,
    the tokenizer, and a factory of engines over them (detokenize=False: an engine that returns ids only)."""
    from llmc.runtime.engine import LLMEngine

    rows = logits_rows(speculative, num_speculative_tokens, max_num_seqs)
    model, tokenizer = load_model(path, kv_cache_memory, max_num_seqs=max_num_seqs, max_num_logits=rows, **load_kw)
    stack.callback(model.close)
    spec = speculative_config(
        speculative, num_speculative_tokens, draft, tokenizer, kv_cache_memory, max_num_seqs, stack
    )

    def make_engine(detokenize: bool = True) -> LLMEngine:
        return LLMEngine(
            model, tokenizer if detokenize else None, enable_prefix_caching=not no_prefix_caching, speculative=spec
        )

    return model, tokenizer, make_engine


def server_app(
    stack: contextlib.ExitStack,
    *,
    path: Path,
    name: str,
    limits,
    api_key: str | None,
    sites=None,
    kv_cache_memory: str | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    no_prefix_caching: bool,
    speculative: str | None,
    num_speculative_tokens: int,
    draft: Path | None,
):
    """The app `llmc serve` runs, over a model that `stack` closes; and the model. sites: its SitePolicy (the Host
    names it answers, CORS), None for any Host and no CORS."""
    from llmc.runtime import server
    from llmc.runtime.async_engine import AsyncLLMEngine

    model, tokenizer, make_engine = engine_parts(
        stack,
        path,
        kv_cache_memory,
        max_num_seqs,
        no_prefix_caching,
        speculative,
        num_speculative_tokens,
        draft,
        max_num_tokens=max_num_batched_tokens,
    )
    app = server.create_app(
        AsyncLLMEngine(make_engine()),
        tokenizer,
        name,
        model.chat_template,
        bos_token=model.bos_token,
        eos_token=model.eos_token,
        limits=limits,
        api_key=api_key,
        sites=sites,
    )
    return app, model


def ray_replica_app(**app_kw):
    """One Ray Serve replica's app (runtime/ray_serve.py calls it in the replica's process) and its close.
    app_kw: server_app's keywords, which travel to the replica pickled."""
    stack = contextlib.ExitStack()
    app, _ = server_app(stack, **app_kw)
    return app, stack.close
