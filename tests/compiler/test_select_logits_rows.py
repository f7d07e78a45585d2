import pytest
import tvm_ffi
from checkpoints import ARCHS
from pass_helpers import apply, before, count_ops, imported, plain_module

from llmc.compiler.passes.select_logits_rows import select_logits_rows


@pytest.mark.parametrize("arch", ARCHS)
def test_final_norm_and_lm_head_run_on_selected_rows(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(select_logits_rows, before(mod, select_logits_rows))
    assert count == 1
    main = out["main"]
    assert "logits_indices" in [p.name for p in main.params]
    rows, vocab = main.ret_ty.shape.values
    assert str(rows) == "B" and int(vocab) == config.vocab_size
    assert count_ops(out, "take") == 3  # the embedding, and the rows of both residual-add operands


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(select_logits_rows, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
