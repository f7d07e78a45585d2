"""The traced module, its ONNX export and its Relax import all reproduce transformers' logits at fp32."""

import numpy as np
import pytest
import torch

from llmc.compiler.export import export_onnx, to_relax
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.frontend.trace import trace
from tests.checkpoints import ARCHS, MOE_ARCHS, VOCAB, hf_model

LENGTHS = (1, 5, 37)
TOL = 1e-4


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g), torch.arange(n)


def _reference(path, ids, pos) -> np.ndarray:
    with torch.no_grad():
        return hf_model(path)(ids[None], position_ids=pos[None]).logits[0].numpy()


@pytest.mark.parametrize("arch", (*ARCHS, *MOE_ARCHS))
def test_traced_program_matches_transformers(arch, checkpoint_dir):
    path = checkpoint_dir(arch)
    ckpt = load_checkpoint(path)
    traced = trace(ckpt.config, device="cpu")
    sig = traced.program.graph_signature
    assert not sig.parameters and not sig.buffers, "weights must be inputs, never captured"
    weights = [ckpt.tensor(n) for n in traced.weight_names]
    run = traced.program.module()
    for n in LENGTHS:
        ids, pos = _inputs(n, seed=n)
        with torch.no_grad():
            got = run(ids, pos, *weights).numpy()
        np.testing.assert_allclose(got, _reference(path, ids, pos), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", (*ARCHS, *MOE_ARCHS))
def test_onnx_matches_transformers(arch, checkpoint_dir, tmp_path):
    import onnxruntime as ort

    path = checkpoint_dir(arch)
    out = export_onnx(load_checkpoint(path), tmp_path / "model.onnx")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for n in (37, 4):
        ids, pos = _inputs(n, seed=100 + n)
        (got,) = session.run(None, {"input_ids": ids.numpy(), "positions": pos.numpy()})
        np.testing.assert_allclose(got, _reference(path, ids, pos), atol=TOL, rtol=0)


def _without_windows_wider_than(mod, length: int):
    """TVM cannot legalize windowed attention; a window no sequence of the test reaches masks nothing."""
    from tvm import relax

    from llmc.compiler.passes.common import calls

    @relax.expr_functor.mutator
    class DropWideWindows(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            window = call.attrs.window_size if calls(call, "relax.nn.attention") else None
            if window is None or int(window) < length:
                return call
            return relax.op.nn.attention(*call.args, scale=call.attrs.scale, causal_mask=call.attrs.causal_mask)

    mod["main"] = DropWideWindows().visit_expr(mod["main"])
    return mod


def _register_softcapped_attention():
    """The VM's kernel for llmc.softcapped_attention (Gemma 2's, which Relax has no op for): the torch reference."""
    import tvm

    from llmc.compiler.frontend.model import softcapped_attention_reference

    def run(q, k, v, scale, window, softcap):
        q, k, v = (torch.from_numpy(t.numpy()).transpose(1, 2) for t in (q, k, v))  # [1, T, H, D] -> [1, H, T, D]
        out = softcapped_attention_reference(q, k, v, scale, softcap, window)
        return tvm.runtime.tensor(out.transpose(1, 2).contiguous().numpy())

    tvm.register_global_func("llmc.softcapped_attention", run, override=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_relax_matches_transformers(arch, checkpoint_dir):
    import tvm
    from tvm import relax

    _register_softcapped_attention()

    path = checkpoint_dir(arch)
    ckpt = load_checkpoint(path)
    traced = trace(ckpt.config)
    # lengths no window cuts (Gemma 3's is 5), so that dropping the windows (mistral's default: 4096) is exact
    c = ckpt.config
    lengths = [
        n for n in LENGTHS if all(n <= c.attention_window(i) or not c.attention_window(i) for i in range(c.num_layers))
    ]
    mod = _without_windows_wider_than(to_relax(traced), max(lengths))
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    weights = [tvm.runtime.tensor(ckpt.tensor(n).numpy()) for n in traced.weight_names]
    for n in lengths:
        ids, pos = _inputs(n, seed=200 + n)
        got = vm["main"](tvm.runtime.tensor(ids.numpy()), tvm.runtime.tensor(pos.numpy()), *weights).numpy()
        np.testing.assert_allclose(got, _reference(path, ids, pos), atol=TOL, rtol=0)


ONNX_VARIANTS = {  # the exported model masks sliding layers to their window and applies YaRN's attention factor
    "sliding": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
}


@pytest.mark.parametrize("variant", ONNX_VARIANTS)
def test_onnx_variant_matches_transformers(variant, checkpoint_dir, tmp_path):
    import onnxruntime as ort

    path = checkpoint_dir("qwen2", **ONNX_VARIANTS[variant])
    out = export_onnx(load_checkpoint(path), tmp_path / "model.onnx")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ids, pos = _inputs(37, seed=7)
    (got,) = session.run(None, {"input_ids": ids.numpy(), "positions": pos.numpy()})
    np.testing.assert_allclose(got, _reference(path, ids, pos), atol=TOL, rtol=0)
