"""The frontend's one entry point: a checkpoint from a path, whichever format it is in.

Either format's chat template is rendered here once, on sample conversations (`check_template`): one that does
not parse, breaks the sandbox's bounds or renders none of them is a CheckpointError before anything is built.
"""

from __future__ import annotations

from pathlib import Path

from llmc.chat_template import check_template
from llmc.errors import ArtifactError, CheckpointError

from .checkpoint import Checkpoint, load_hf_checkpoint
from .gguf import load_gguf


def load_checkpoint(path: str | Path) -> Checkpoint:
    """A Hugging Face checkpoint directory (checkpoint.py), or a GGUF file (gguf.py)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory", "pass a Hugging Face checkpoint directory")
    if path.is_file() and path.suffix.lower() == ".gguf":
        ckpt = load_gguf(path)
        _check_chat_template(ckpt, f"{path} (tokenizer.chat_template)", "re-convert the model with a working template")
        return ckpt
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory", "pass the checkpoint's directory or a .gguf file")
    ckpt = load_hf_checkpoint(path)
    where = path / "chat_template.jinja" if (path / "chat_template.jinja").is_file() else path / "tokenizer_config.json"
    _check_chat_template(ckpt, str(where), f"fix the chat template in {where.name}")
    return ckpt


def _check_chat_template(ckpt: Checkpoint, where: str, hint: str) -> None:
    """The checkpoint's chat template, rendered once on sample conversations (llmc/chat_template.py), so that one
    that could not serve a conversation is refused now, not at every request of a server."""
    try:
        check_template(
            ckpt.chat_template, ckpt.special_tokens.get("bos_token", ""), ckpt.special_tokens.get("eos_token", "")
        )
    except ArtifactError as e:
        what = " ".join(e.what.split())  # one line, whatever the template's error message holds
        raise CheckpointError(f"{where}: {what}", hint) from None
