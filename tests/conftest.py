from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(variant, **overrides) -> Path of a tiny random fp32 checkpoint, built once per session."""
    made: dict = {}

    def get(variant: str, **overrides) -> Path:
        key = (variant, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"ckpt_{variant}")
            made[key] = make_checkpoint(out, variant, **overrides)
        return made[key]

    return get
