"""The bundled models (train_tiny.py made them): the default checkpoint `llmc run` compiles, and its draft."""

from pathlib import Path

from llmc.errors import LlmcError

EXAMPLES_DIR = Path(__file__).resolve().parent


def bundled_checkpoint() -> Path:
    """The checkpoint shipped in llmc/examples (the one dir there with a config.json, its *-draft model aside)."""
    found = sorted(p.parent for p in EXAMPLES_DIR.glob("*/config.json") if not p.parent.name.endswith("-draft"))
    if not found:
        raise LlmcError(f"no bundled model found in {EXAMPLES_DIR}", "pass an artifact or a checkpoint: llmc run PATH")
    return found[0]
