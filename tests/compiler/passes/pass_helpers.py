"""Helpers for the pass tests: the imported Relax module of a tiny checkpoint, and a pass runner that
prints the module before and after, checks it is well formed, and returns the rewrite count."""

from tvm import relax

from llmc.compiler.export import to_relax
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.frontend.trace import trace
from llmc.compiler.passes.common import bindings, llmc_op_name, rewrite_counts

_imported = {}


def imported(checkpoint_dir, arch: str):
    """(Relax module as traced, ModelConfig) of the tiny `arch` checkpoint, imported once per session."""
    if arch not in _imported:
        ckpt = load_checkpoint(checkpoint_dir(arch))
        _imported[arch] = (to_relax(trace(ckpt.config)), ckpt.config)
    return _imported[arch]


def apply(pass_fn, mod):
    """Run one pass, print the module before and after, check well-formedness; -> (module, count)."""
    print(f"--- before {pass_fn.__name__} ---\n{mod.script()}")
    out = pass_fn(mod)
    relax.analysis.well_formed(out)
    count = rewrite_counts(out)[pass_fn.__name__]
    print(f"--- after {pass_fn.__name__}: rewrote {count} ---\n{out.script()}")
    return out, count


def count_ops(mod, name: str) -> int:
    """How many bindings of main are the llmc op `name` or the Relax op `relax.<name>`."""
    n = 0
    for b in bindings(mod["main"]):
        v = b.value
        if llmc_op_name(v) == name or (isinstance(v, relax.Call) and getattr(v.op, "name", None) == f"relax.{name}"):
            n += 1
    return n


def plain_module():
    """A module with none of the patterns: every pass must leave it as it is."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 8], "float32"))
    p = relax.Var("p", relax.TensorType([4], "int64"))
    with bb.function("main", [x, p]):
        with bb.dataflow():
            y = bb.emit(relax.op.multiply(x, relax.op.sigmoid(x)))
            z = bb.emit_output(relax.op.add(y, x))
        bb.emit_func_output(z)
    return bb.get()


def before(mod, pass_fn):
    """The module as the pipeline hands it to `pass_fn`: every earlier pass applied."""
    from llmc.compiler.passes.pipeline import PASSES

    for p in PASSES[: PASSES.index(pass_fn)]:
        mod = p(mod)
    return mod
