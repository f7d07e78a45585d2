"""The bytes of weights a batch-1 decode step reads (the memory roofline's, in `llmc bench` and the benchmarks),
from an artifact's kernel program: the whole weights file, less the embedding table but for the one row a token
reads; a tied table is read in full as the lm_head too."""

import json

import pytest

from llmc.artifact import load_artifact
from llmc.compiler.compile import compile_checkpoint
from llmc.compiler.quant import QuantConfig
from tests.checkpoints import VOCAB


@pytest.mark.parametrize(
    "variant, options",
    [("llama", {}), ("mistral", {}), ("llama", {"quant": QuantConfig("int4", group_size=32)})],
    ids=["untied", "tied", "untied-int4"],
)
def test_decode_reads_one_embedding_row(checkpoint_dir, tmp_path, variant, options):
    ckpt = checkpoint_dir(variant)
    out = compile_checkpoint(ckpt, target="cpu", output=tmp_path / "m.cpu", weight_dtype="float32", **options)
    artifact = load_artifact(out)
    with open(artifact.weights_path, "rb") as f:  # the weights' bytes, without the alignment padding tensors
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tensors = sum(e - b for k, v in header.items() if not k.startswith("__") for b, e in [v["data_offsets"]])
    hidden = artifact.config.hidden_size
    table = VOCAB * hidden * 4  # float32, unquantized in every build here (the lm_head is not quantized)
    if variant == "mistral":  # tied: the lm_head reads the whole table, the embedding one row more
        assert artifact.decode_weight_bytes == tensors + hidden * 4
    else:
        assert artifact.decode_weight_bytes == tensors - table + hidden * 4
