"""The compile cache behind `llmc run CHECKPOINT`: compiled once per key, recompiled when a key part changes."""

from llmc.compiler import compile as compile_module
from llmc.tools import build as cache


def test_cache_key_changes_with_the_abi(checkpoint_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    compiled = []

    def fake_compile(ckpt, *, output, **kw):
        output.mkdir(parents=True)
        (output / "manifest.json").write_text("{}")
        compiled.append(output)

    monkeypatch.setattr(compile_module, "compile_checkpoint", fake_compile)
    ckpt = checkpoint_dir("llama")
    first = cache.cached_artifact(ckpt, progress=False)
    assert cache.cached_artifact(ckpt, progress=False) == first and len(compiled) == 1
    # an artifact built for another C ABI (or format) version cannot be loaded: it must not be handed out
    monkeypatch.setattr(cache, "ABI_VERSION", cache.ABI_VERSION + 1)
    assert cache.cached_artifact(ckpt, progress=False) != first and len(compiled) == 2
