from click.testing import CliRunner

from llmc.compiler.passes.pipeline import PASSES
from llmc.tools.cli import main


def test_inspect_passes_reports_every_pass_and_the_kernel_program(checkpoint_dir):
    # Gemma 2: the family that every pass rewrites (fuse_softcap is its own)
    result = CliRunner().invoke(main, ["inspect", str(checkpoint_dir("gemma2")), "--passes"])
    assert result.exit_code == 0, result.output
    for p in PASSES:
        assert f"    {p.__name__} " in result.output
    assert "no pattern found" not in result.output
    assert "kernel program:" in result.output and "paged_attention(" in result.output


def test_inspect_passes_with_quant_shows_quantize_linear_and_the_qgemms(checkpoint_dir):
    result = CliRunner().invoke(main, ["inspect", str(checkpoint_dir("llama")), "--passes", "--quant", "int4"])
    assert result.exit_code == 0, result.output
    assert "    quantize_linear " in result.output and "6 rewrites" in result.output  # qkv, o, gate/up x 2 layers
    assert "qgemm(n=96, k=64, bits=4, group_size=32" in result.output and ".qweight: uint8[96, 32]" in result.output
