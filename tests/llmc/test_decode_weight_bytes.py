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


@pytest.mark.parametrize("options", [{}, {"quant": QuantConfig("int4", group_size=32)}], ids=["fp32", "int4"])
def test_decode_reads_the_chosen_experts_only(checkpoint_dir, tmp_path, options):
    """Mixtral (5 experts, top 2, tied): a token's step reads 2 of each layer's 5 experts, and the rest in full."""
    out = compile_checkpoint(checkpoint_dir("mixtral"), target="cpu", output=tmp_path / "m.cpu", **options)
    artifact = load_artifact(out)
    with open(artifact.weights_path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    sizes = {k: e - b for k, v in header.items() if not k.startswith("__") for b, e in [v["data_offsets"]]}
    experts = sum(n for k, n in sizes.items() if ".experts." in k)
    assert experts and experts % 5 == 0
    hidden = artifact.config.hidden_size
    assert artifact.decode_weight_bytes == sum(sizes.values()) - experts + experts * 2 // 5 + hidden * 4
