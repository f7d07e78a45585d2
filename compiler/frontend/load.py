"""The frontend's one entry point: a checkpoint from a path, whichever format it is in."""

from __future__ import annotations

from pathlib import Path

from llmc.errors import CheckpointError

from .checkpoint import Checkpoint, load_hf_checkpoint
from .gguf import load_gguf


def load_checkpoint(path: str | Path) -> Checkpoint:
    """A Hugging Face checkpoint directory (checkpoint.py), or a GGUF file (gguf.py)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory", "pass a Hugging Face checkpoint directory")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory", "pass the checkpoint's directory or a .gguf file")
    return load_hf_checkpoint(path)
