"""templates/cpu/tvm_call.cc.j2: a TVM-generated kernel (the fallback for ops no template covers) behind the
template's plain-pointer signature, with templates/cpu/tvm_backend.cc as its runtime. Compared with numpy at
row counts that are not multiples of anything, including ops whose TVM code allocates a workspace (silu)."""

import ctypes

import numpy as np
import pytest
import tvm
from tvm import relax

from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
from llmc.compiler.codegen.render import kernel_id, render_kernel, target_headers, template_file
from llmc.compiler.codegen.tvm_fallback import c_source, include_dirs
from llmc.compiler.legalize import legalize_call

ROWS = tvm.tirx.Var("T", "int64")


# name: (relax op on the inputs, input shapes, output shape, numpy reference); "T" is the row count
CASES = {
    # silu's TIR keeps sigmoid(x) in a T-sized workspace
    "silu": (lambda x: relax.op.nn.silu(x), [[1, "T", 37]], [1, "T", 37], lambda x: x / (1 + np.exp(-x))),
    "mul_weight": (lambda x, w: relax.op.multiply(x, w), [["T", 53], [53]], ["T", 53], lambda x, w: x * w),
    "mean": (
        lambda x: relax.op.mean(x, axis=[-1], keepdims=True),
        [[1, "T", 45]],
        [1, "T", 1],
        lambda x: x.mean(-1, keepdims=True),
    ),
    "add": (lambda x, y: relax.op.add(x, y), [["T", 29], ["T", 29]], ["T", 29], lambda x, y: x + y),
}


def _ty(dims):
    return relax.TensorType([ROWS if d == "T" else d for d in dims], "float32")


@pytest.fixture(scope="module")
def kernels():
    funcs, sources, wrappers = {}, [], {}
    for case, (build, in_shapes, out_dims, _) in CASES.items():
        params = [relax.Var(f"a{i}", _ty(s)) for i, s in enumerate(in_shapes)]
        funcs[f"tvm_{case}"] = legalize_call(build(*params), params)
        spec = {"func": f"tvm_{case}", "num_inputs": len(in_shapes), "shapes": [*in_shapes, out_dims]}
        kid = kernel_id("cpu", "tvm_call", spec)
        sources.append(render_kernel("cpu", "tvm_call", name=kid, **spec))
        args = ", ".join(f"float* a{i}" for i in range(len(in_shapes) + 1))
        names = ", ".join(f"a{i}" for i in range(len(in_shapes) + 1))
        sources.append(f'extern "C" int test_{case}({args}, int T) {{ return {kid}({names}, T, 0); }}')
        wrappers[case] = len(in_shapes) + 1
    # the TVM function called directly with a shape its checks refuse (29 columns declared as 30)
    sources.append(
        'extern "C" int test_bad_shape(float* x, int T) { const int64_t s[] = {T, 30}; '
        "return llmc::call_tvm<3>(__tvm_ffi_tvm_add, {x, x, x}, {s, s, s}, {2, 2, 2}); }"
    )
    files = {
        **target_headers("cpu"),
        "kernels.cc": '#include "common.h"\n' + "\n".join(sources),
        "tvm_kernels.cc": c_source(funcs),
        "tvm_backend.cc": template_file("cpu", "tvm_backend.cc"),
    }
    flags = [*CPU_FLAGS, *(f"-I{d}" for d in include_dirs()), "-Wl,-Bsymbolic"]
    lib = ctypes.CDLL(str(build_shared_library(files, flags=flags)))
    for case, n in wrappers.items():
        getattr(lib, f"test_{case}").argtypes = [ctypes.c_void_p] * n + [ctypes.c_int]
    return lib


@pytest.mark.parametrize("T", [1, 5, 37])
@pytest.mark.parametrize("case", CASES)
def test_tvm_kernel_matches_numpy(kernels, case, T):
    _, in_shapes, out_dims, reference = CASES[case]
    rng = np.random.default_rng(T)
    inputs = [rng.standard_normal([T if d == "T" else d for d in s]).astype(np.float32) for s in in_shapes]
    out = np.full([T if d == "T" else d for d in out_dims], np.nan, dtype=np.float32)
    rc = getattr(kernels, f"test_{case}")(*(a.ctypes.data for a in [*inputs, out]), T)
    assert rc == 0
    np.testing.assert_allclose(out, reference(*inputs), rtol=1e-5, atol=1e-6)


def test_a_refused_call_returns_nonzero_and_says_why(kernels, capfd):
    x = np.zeros((3, 30), np.float32)
    kernels.test_bad_shape.argtypes = [ctypes.c_void_p, ctypes.c_int]
    assert kernels.test_bad_shape(x.ctypes.data, 3) != 0
    err = capfd.readouterr().err
    assert "llmc: TVM fallback kernel: ValueError" in err and "shape[1]" in err
