import pytest
import tvm_ffi
from checkpoints import ARCHS
from pass_helpers import apply, before, count_ops, imported, plain_module

from llmc.compiler.compile import check_fusion
from llmc.compiler.passes.fuse_attention import fuse_attention
from llmc.errors import CompileError


@pytest.mark.parametrize("arch", ARCHS)
def test_rewrites_causal_attention_to_paged(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(fuse_attention, before(mod, fuse_attention))
    assert count == config.num_layers
    assert count_ops(out, "paged_attention") == config.num_layers
    assert count_ops(out, "nn.attention") == 0
    assert count_ops(out, "rope") == 0  # folded into paged attention
    assert count_ops(out, "broadcast_to") == 0  # the GQA repeat is gone: the kernel maps heads
    names = [p.name for p in out["main"].params]
    for name in ("seq_lens", "query_start_loc", "block_tables", "slot_mapping"):
        assert name in names
    caches = [p for p in out["main"].params if p.name.startswith("kv_cache_")]
    assert len(caches) == config.num_layers
    shape = caches[0].ty.shape.values
    assert (int(shape[0]), int(shape[3]), int(shape[4])) == (2, config.num_kv_heads, config.head_dim)


def test_leaves_other_graphs_alone_and_compile_refuses():
    mod = plain_module()
    out, count = apply(fuse_attention, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
    with pytest.raises(CompileError, match="fuse_attention rewrote 0 of 2"):
        check_fusion(out, num_layers=2)


def test_unfused_rope_blocks_the_rewrite(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "llama")
    out, count = apply(fuse_attention, mod)  # no fuse_rope before it
    assert count == 0
    assert count_ops(out, "nn.attention") == config.num_layers
    with pytest.raises(CompileError):
        check_fusion(out, config.num_layers)
