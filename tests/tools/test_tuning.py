"""Kernel autotuning (compiler/tuning/): tunable spaces and their constraints, the reference check that rejects
a wrong candidate before it is timed, the database round trip, and compile taking the tuned entries that
match its shapes and this host's ISA (and no others), with numbers identical to the defaults'.
"""

import json
import os
import stat
import time

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.compiler.codegen.simulator import build_simulated
from llmc.compiler.quant import QuantConfig
from llmc.compiler.tuning.database import TuningDB, cpu_machine, entry_key
from llmc.compiler.tuning.space import Tunable, TuneSpace, tune_space
from llmc.errors import CompileError
from llmc.host import host_cpu_isa
from llmc.manifest import read_manifest
from llmc.runtime.batch import StepBatch
from llmc.runtime.module import CompiledModel
from llmc.targets import load_target
from llmc.tools.build import compile_checkpoint
from llmc.tools.cli import main
from llmc.tools.tuning import measure_cuda, simulate_cuda, tuner
from llmc.tools.tuning.measure_cpu import render_candidate
from llmc.tools.tuning.reference import KernelShape
from llmc.tools.tuning.tuner import model_shapes, parse_shape, tune

# A shape with tails: n and k no multiple of a tile, a task or a vector.
SHAPE = KernelShape.of("gemm", dict(n=203, k=72, wdtype="bf16", has_bias=True))
SMALL = TuneSpace(
    "cpu/gemm",
    (Tunable("prefetch_bytes", 16384, (0, 16384), ""), Tunable("task_bytes", 32768, (16384, 32768), "")),
)


def test_spaces_declare_defaults_inside_their_domains():
    for op in ("gemm", "qgemm"):
        space = tune_space("cpu", op)
        assert space is not None and space.rows == (1,)
        for p in space.params:
            assert p.default in p.domain, p
        configs = space.candidates({"n": 64, "k": 64}, {})
        assert configs[0] == space.defaults() and len(configs) == len({tuple(c.items()) for c in configs})
    assert tune_space("cpu", "rmsnorm") is None


def test_constraints_prune_candidates():
    space = TuneSpace(
        "cuda/example",
        (Tunable("bm", 64, (32, 64, 128), ""), Tunable("bk", 16, (8, 16, 32), "")),
        ("bm * bk * 4 * 2 <= max_shared_memory_per_block", "bm <= n or bm == 32", "registers * bm <= 8192"),
    )
    limits = {"max_shared_memory_per_block": 16384, "registers": 64}
    got = space.candidates({"n": 64}, limits)
    assert all(c["bm"] * c["bk"] * 8 <= 16384 and c["bm"] <= 64 for c in got)
    assert {"bm": 128, "bk": 8} not in got and {"bm": 64, "bk": 32} in got
    assert {"bm": 64, "bk": 32} not in space.candidates({"n": 64}, {**limits, "registers": 255})  # ptxas's count
    with pytest.raises(CompileError, match="names 'warps'"):
        TuneSpace("x", space.params, ("warps < 4",)).candidates({"n": 1}, limits)
    with pytest.raises(CompileError, match="not allowed"):
        TuneSpace("x", space.params, ("__import__('os')",)).candidates({"n": 1}, limits)


def _wrong(config):
    def render(shape, c):
        kid, src = render_candidate(shape, c)
        if c == config:  # the kernel itself adds 1 to its first output
            src = src.replace("y, T);\n}", "y, T);\n  y[0] += 1.0f;\n}", 1)
        return kid, src

    return render


def test_a_wrong_candidate_is_rejected_and_never_wins(tmp_path, caplog):
    bad = {"prefetch_bytes": 0, "task_bytes": 16384}
    db = TuningDB.load(tmp_path / "cpu.tuning.json", "cpu")
    (r,) = tune("cpu", [SHAPE], db, rounds=1, progress=False, render=_wrong(bad), space=SMALL)
    rejected = [c for c in r.candidates if c.rejected]
    assert [c.config for c in rejected] == [bad] and "off the reference" in rejected[0].rejected
    assert not rejected[0].times and r.config != bad
    assert "rejected" in caplog.text
    (entry,) = db.entries
    assert entry["figures"]["rejected"] == 1 and entry["figures"]["candidates"] == 4


@pytest.mark.parametrize(
    "scheme,quant",
    [
        ("bits=4,group_size=32,asymmetric=1", "int4_g32_asym_kscales"),
        ("bits=6,group_size=16,asymmetric=0", "int6_g16_kscales"),
    ],
)
def test_kquant_record_gemms_tune(tmp_path, scheme, quant):
    """A qgemm reading K-quant superblock records (scale_bits 8: q4_k, a GGUF's Q4_K; Q6_K's) builds, checks
    against its reference and is timed; its entry's quant names the records."""
    shape = parse_shape(f"qgemm:n=37,k=512,{scheme},scale_bits=8")
    space = TuneSpace("cpu/qgemm", (Tunable("prefetch_bytes", 16384, (0, 16384), ""),))
    db = TuningDB.load(tmp_path / "cpu.tuning.json", "cpu")
    (r,) = tune("cpu", [shape], db, rounds=1, progress=False, space=space)
    assert not any(c.rejected for c in r.candidates) and len(r.candidates) == 2
    (entry,) = db.entries
    assert entry["key"]["quant"] == quant and entry["figures"]["rejected"] == 0


def test_database_round_trips_and_ranks_entries(tmp_path):
    path = tmp_path / "cpu.tuning.json"
    db = TuningDB.load(path, "cpu")
    key = entry_key("cpu/gemm", SHAPE.kwargs, {"prefetch_bytes", "task_bytes"})
    assert key == {
        "template": "cpu/gemm",
        "shape": {"has_bias": True, "k": 72, "n": 203},
        "dtype": "bf16",
        "quant": "none",
    }
    here, other = cpu_machine(2), {**cpu_machine(2), "isa": ["sse2"]}
    db.put(key, {"prefetch_bytes": 0, "task_bytes": 16384}, {"time_us": 1.0}, "measured", here)
    db.put(key, {"prefetch_bytes": 4096, "task_bytes": 16384}, {}, "simulated", here)  # does not replace it
    db.put(key, {"prefetch_bytes": 8192, "task_bytes": 65536}, {}, "measured", other)
    db.save()
    again = TuningDB.load(path, "cpu")
    assert again.entries == db.entries and len(again.entries) == 2
    assert again.lookup(key, here["isa"])["params"] == {"prefetch_bytes": 0, "task_bytes": 16384}
    assert again.lookup(key, ["sse2"])["params"]["task_bytes"] == 65536
    assert again.lookup(key, ["avx"]) is None and len(again.ignored(key, ["avx"])) == 2
    path.write_text(json.dumps({"version": 1, "target": "sm90", "entries": []}))
    with pytest.raises(CompileError, match="for target 'sm90'"):
        TuningDB.load(path, "cpu")
    path.write_text("{")
    with pytest.raises(CompileError, match="cannot be read"):
        TuningDB.load(path, "cpu")


def _logits(artifact, ids):
    model = CompiledModel.load(artifact, max_num_logits=64)
    table = list(range(model.num_blocks))[: -(-(len(ids) + 1) // model.block_size)]
    prefill = model.step(StepBatch.build([ids], [0], [table], model.block_size, num_logits=[len(ids)]))
    nxt = int(np.argmax(prefill[-1]))
    decode = model.step(StepBatch.build([[nxt]], [len(ids)], [table], model.block_size))  # T = 1: the GEMV
    model.close()
    return np.concatenate([prefill, decode])


def test_compile_takes_tuned_entries_for_this_isa_only(checkpoint_dir, tmp_path):
    ckpt = checkpoint_dir("qwen2")  # qkv bias: a tunable GEMM with bias
    shapes = model_shapes(ckpt, "cpu", "bfloat16")
    assert {s.op for s in shapes} == {"gemm"} and len(shapes) >= 4
    db = TuningDB.load(tmp_path / "cpu.tuning.json", "cpu")
    space = tune_space("cpu", "gemm")
    tuned = {"prefetch_bytes": 0, "task_bytes": 131072}  # no prefetch, one task: far from the defaults
    for s in shapes[:-1]:
        db.put(entry_key("cpu/gemm", s.kwargs, space.names), tuned, {}, "measured", cpu_machine(2))
    foreign = {**cpu_machine(2), "cpu": "another CPU", "isa": ["sse2"]}
    db.put(entry_key("cpu/gemm", shapes[-1].kwargs, space.names), tuned, {}, "measured", foreign)
    db.save()
    art = compile_checkpoint(ckpt, output=tmp_path / "tuned", weight_dtype="bfloat16", tuning_db=db.path)
    plain = compile_checkpoint(ckpt, output=tmp_path / "plain", weight_dtype="bfloat16", tuning_db=False)

    m = read_manifest(art)
    kernels = m["tuning"]["kernels"]
    measured = {k for k, v in kernels.items() if v["source"] == "measured"}
    assert len(measured) == len(shapes) - 1 and all(kernels[k]["params"] == tuned for k in measured)
    assert all(k.endswith("_pf0_task131072") for k in measured)
    (default,) = set(kernels) - measured
    assert kernels[default]["source"] == "default" and kernels[default]["params"] == space.defaults()
    assert "another CPU" in kernels[default]["ignored"][0]
    assert "llmc::gemm<" in (art / "model.cc").read_text() and ", 0, 131072>(x, w" in (art / "model.cc").read_text()
    assert "tuning" not in read_manifest(plain) or all(
        v["source"] == "default" for v in read_manifest(plain)["tuning"]["kernels"].values()
    )
    out = CliRunner().invoke(main, ["inspect", str(art)])
    assert out.exit_code == 0 and f"{len(measured)} measured" in out.output and "1 default" in out.output

    ids = [int(i) for i in np.random.default_rng(1).integers(2, 384, 37)]
    assert np.array_equal(_logits(art, ids), _logits(plain, ids))  # tunables change the speed, not the numbers


def test_a_qgemm_writing_columns_of_a_wider_output_is_tuned_as_its_own(checkpoint_dir):
    """q4_k_m's layer with a wider attn_v runs q / k and v as two qgemms writing one buffer (ldy): each is timed,
    and keyed, as a qgemm of its own [T, n] output."""
    from llmc.compiler.compile import build_program, quant_schemes
    from llmc.compiler.frontend.load import load_checkpoint

    ckpt, quant = checkpoint_dir("llama"), QuantConfig("q4_k_m")
    loaded = load_checkpoint(ckpt)
    program = build_program(loaded, "float32", 16, schemes=quant_schemes(loaded, quant))
    strided = [launch.params for launch in program.launches if "ldy" in launch.params]
    assert len(strided) == 2  # the tiny model's one more_bits layer: q / k, then v
    shapes = {s for s in model_shapes(ckpt, "cpu", "float32", quant=quant) if s.op == "qgemm"}
    assert all("ldy" not in s.kwargs for s in shapes)
    assert {KernelShape.of("qgemm", {k: v for k, v in p.items() if k != "ldy"}) for p in strided} <= shapes


def test_an_entry_older_than_a_tunable_takes_its_default(checkpoint_dir, tmp_path):
    """An entry tuned before a tunable existed (qgemm's entries from before gemv_cols) compiles with that
    tunable at its default, the template's code when it was tuned; an entry naming no such tunable is refused."""
    ckpt = checkpoint_dir("llama")
    quant = QuantConfig("int8", group_size=32)
    (shape, *_) = [s for s in model_shapes(ckpt, "cpu", quant=quant) if s.op == "qgemm"]
    space = tune_space("cpu", "qgemm")
    db = TuningDB.load(tmp_path / "cpu.tuning.json", "cpu")
    older = {"prefetch_bytes": 0, "task_bytes": 131072}
    assert "gemv_cols" in space.names and not space.names <= older.keys()
    db.put(entry_key("cpu/qgemm", shape.kwargs, space.names), older, {}, "measured", cpu_machine(2))
    db.save()
    art = compile_checkpoint(ckpt, output=tmp_path / "m", quant=quant, tuning_db=db.path)
    taken = [k for k in read_manifest(art)["tuning"]["kernels"].values() if k["source"] == "measured"]
    assert taken and all(k["params"] == {**space.defaults(), **older} for k in taken)
    db.put(entry_key("cpu/qgemm", shape.kwargs, space.names), {**older, "unroll": 2}, {}, "measured", cpu_machine(2))
    db.save()
    with pytest.raises(CompileError, match="retune this shape"):
        compile_checkpoint(ckpt, output=tmp_path / "m2", quant=quant, tuning_db=db.path)


def test_tune_command_writes_the_database_and_resumes(checkpoint_dir, tmp_path):
    """A budget that runs out part way (CI's own `llmc tune` step tunes a whole model), then a run with none
    left: what the first wrote is kept and reported, nothing is retuned."""
    db = tmp_path / "cpu.tuning.json"
    args = ["tune", "--model", str(checkpoint_dir("llama")), "--rounds", "1", "--db", str(db)]
    first = CliRunner().invoke(main, [*args, "--budget", "90"])
    assert first.exit_code == 0, first.output
    entries = json.loads(db.read_text())["entries"]
    assert entries and all(e["source"] == "measured" and e["machine"]["isa"] == host_cpu_isa() for e in entries)
    assert all(e["figures"]["rejected"] == 0 and e["figures"]["time_us"] > 0 for e in entries)
    second = CliRunner().invoke(main, [*args, "--budget", "0"])
    assert second.exit_code == 0 and second.output.count("(already tuned)") == len(entries), second.output
    assert json.loads(db.read_text())["entries"] == entries


# exclusive: all 40 candidates must be built and timed within the budget, which another worker's builds would eat
@pytest.mark.slow
@pytest.mark.exclusive
def test_tune_quantized_gemms(checkpoint_dir, tmp_path):
    """int4 linears with fp16 scales (the default): every candidate checked and timed, none rejected."""
    db = tmp_path / "cpu.tuning.json"
    args = [
        "tune",
        "--model",
        str(checkpoint_dir("llama")),
        "--quant",
        "int4",
        "--budget",
        "600",
        "--rounds",
        "1",
        "--db",
        str(db),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    entries = [e for e in json.loads(db.read_text())["entries"] if e["key"]["template"] == "cpu/qgemm"]
    assert entries and all(e["figures"]["rejected"] == 0 and e["figures"]["candidates"] == 40 for e in entries)


def test_timing_a_cuda_target_without_a_gpu_is_a_clear_error(tmp_path):
    out = CliRunner().invoke(main, ["tune", "--target", "sm90", "--db", str(tmp_path / "x.json")])
    assert out.exit_code != 0 and "--simulate" in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(main, ["tune", "--simulate", "--db", str(tmp_path / "x.json")])
    assert out.exit_code != 0 and "CUDA" in out.output and "Traceback" not in out.output


# The CUDA gemm with its GEMV group and its tiled group cut down; the ptxas constraint refuses 8 GEMV warps by
# the registers ptxas reports (an artificial limit: any kernel uses more than 8).
CUDA_SPACE = TuneSpace(
    "cuda/gemm",
    (
        Tunable("gemv_warps", 4, (4, 8), "", "gemv"),
        Tunable("tile_m", 64, (32, 64), "", "tiled"),
        Tunable("tile_n", 64, (64,), "", "tiled"),
        Tunable("tile_k", 16, (16,), "", "tiled"),
    ),
    ("(tile_m // 4) * (tile_n // 4) <= 1024",),
    (1, 40),
    ("spill_bytes == 0", "gemv_warps == 4 or registers < 8"),
)


def test_simulated_tuning_prunes_by_ptxas_checks_and_ranks_by_prediction(tmp_path):
    shape = parse_shape("gemm:n=72,k=40,wdtype=bf16,has_bias=1", "sm90")  # tails: n, k no multiple of a tile or vector
    db = TuningDB.load(tmp_path / "sm90.tuning.json", "sm90")
    (r,) = tune("sm90", [shape], db, simulate=True, progress=False, space=CUDA_SPACE)
    by_config = {(c.config["gemv_warps"], c.config["tile_m"]): c for c in r.candidates}
    assert set(by_config) == {(4, 64), (8, 64), (4, 32)}
    assert by_config[8, 64].rejected.startswith("ptxas:") and not by_config[8, 64].times
    for key in ((4, 64), (4, 32)):
        c = by_config[key]
        assert c.rejected is None and c.times[0] > 0 and c.figures["registers"] > 0 and c.figures["blocks"] > 0
    # 40 rows of 72 outputs: 32-row tiles make 4 blocks where 64-row ones make 2, on a 132-SM part
    assert by_config[4, 32].times[0] < by_config[4, 64].times[0] and r.config["tile_m"] == 32
    (entry,) = db.entries
    assert entry["source"] == "simulated" and "gpu" in entry["machine"] and entry["figures"]["rejected"] == 1
    assert entry["params"] == {"gemv_warps": 4, "tile_m": 32, "tile_n": 64, "tile_k": 16}
    # a measured entry replaces it; a simulated one does not replace that
    db.put(entry["key"], CUDA_SPACE.defaults(), {}, "measured", {"gpu": "H200"})
    db.put(entry["key"], entry["params"], {}, "simulated", {"gpu": "H200 (simulated)"})
    assert [e["source"] for e in db.entries] == ["measured"]


def test_ptxas_figures_give_each_kernel_its_own_registers():
    """A block rule of the GEMV reads the GEMV's registers, not the tiled kernel's (the candidate's most)."""
    shape = parse_shape("gemm:n=72,k=40,wdtype=bf16", "sm90")
    _, source = simulate_cuda.render_candidate(shape, CUDA_SPACE.defaults())
    figures = simulate_cuda.ptxas_figures(load_target("sm90"), source)
    assert 0 < figures["gemv_registers"] and 0 < figures["tiled_registers"]
    assert figures["registers"] == max(figures["gemv_registers"], figures["tiled_registers"])
    assert figures["gemv_registers"] != figures["tiled_registers"]  # so that reading the wrong one would show


def test_simulated_tuning_checks_the_swiglu_gemm_against_its_reference(tmp_path):
    """The SwiGLU GEMM's candidates run on interleaved gate / up weights and meet silu(gate) * up: every one
    passes the check (a wrong layout or epilogue would be rejected), and one wins."""
    shape = parse_shape("gemm_swiglu:inter=40,k=48,wdtype=bf16", "sm90")  # 5 groups of 8: a zero-filled tile tail
    space = TuneSpace(
        "cuda/gemm_swiglu",
        (
            Tunable("gemv_warps", 4, (4,), "", "gemv"),
            Tunable("tile_m", 64, (32, 64), "", "tiled"),
            Tunable("tile_n", 64, (64,), "", "tiled"),
            Tunable("tile_k", 16, (16,), "", "tiled"),
            Tunable("stages", 3, (3,), "", "pipeline"),
        ),
        (),
        (1, 40),
        ("spill_bytes == 0",),
    )
    db = TuningDB.load(tmp_path / "sm90.tuning.json", "sm90")
    (r,) = tune("sm90", [shape], db, simulate=True, progress=False, space=space)
    assert len(r.candidates) == 2 and all(c.rejected is None and c.times[0] > 0 for c in r.candidates)
    assert db.entries[0]["key"]["template"] == "cuda/gemm_swiglu"


def test_gpu_timing_checks_then_times_with_cuda_events_under_the_simulator(tmp_path):
    """measure_cuda's path (ptxas pruning, the check at every row before timing, CUDA events around the
    launches) with the simulator's runtime standing in for a GPU's: its times are the simulator's wall time, so
    only the mechanics are tested here; the figures come from a GPU."""
    shape = parse_shape("gemm:n=72,k=40,wdtype=bf16,has_bias=1", "sm90")

    def render(shape, config):
        kid, source = measure_cuda.render_candidate(shape, config)
        if config["tile_m"] == 32:  # a wrong candidate: its output is zeroed after the launch
            source = source.replace("launch(0);", "launch(0);\n    cudaMemset(d.y, 0, y_bytes);")
        return kid, source

    candidates = measure_cuda.measure_shape(
        shape,
        CUDA_SPACE,
        load_target("sm90"),
        time.monotonic() + 600,
        2,
        render=render,
        build=lambda target, source, out: build_simulated(source, out),
        span_bytes=0,
        min_time=0.0,
    )
    by_config = {(c.config["gemv_warps"], c.config["tile_m"]): c for c in candidates}
    assert by_config[8, 64].rejected.startswith("ptxas:") and not by_config[8, 64].times
    assert "off the reference" in by_config[4, 32].rejected and not by_config[4, 32].times
    assert by_config[4, 64].rejected is None and len(by_config[4, 64].times) == 2
    assert all(t > 0 for t in by_config[4, 64].times)


def _one_line_error(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_the_database_is_written_only_as_a_regular_file_in_a_directory_that_exists(tmp_path):
    """save() replaces a regular file whole, and refuses (one line, nothing left behind) a directory, a FIFO or
    device, a symlink (replacing it would not write where it leads) and a missing directory (not created)."""
    db = TuningDB(tmp_path / "ok.json", "cpu", [])
    db.save()
    db.save()  # replaces the file it wrote
    assert json.loads((tmp_path / "ok.json").read_text())["entries"] == []
    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "link.json").symlink_to(tmp_path / "ok.json")
    cases = {
        "dir.json": "is a directory",
        "fifo.json": "not a regular file",
        "link.json": "is a symlink",
        "nope/db.json": "no such directory",
    }
    for name, words in cases.items():
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(CompileError, match=words):
            TuningDB(tmp_path / name, "cpu", []).save()
        assert sorted(os.listdir(tmp_path)) == before, f"{name}: no temporary file or directory is left"
    assert (tmp_path / "link.json").is_symlink() and stat.S_ISFIFO(os.lstat(tmp_path / "fifo.json").st_mode)


def test_tune_says_wrote_only_when_it_wrote(tmp_path):
    db = tmp_path / "x.json"
    r = CliRunner().invoke(main, ["tune", "--shape", "gemm:n=64,k=64,wdtype=f32", "--budget", "0", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert not any(line.startswith("wrote") for line in r.output.splitlines()), r.output
    assert f"nothing tuned: {db} not written" in r.output and not db.exists()


def test_a_budget_that_is_not_a_number_is_refused(tmp_path):
    r = CliRunner().invoke(
        main, ["tune", "--shape", "gemm:n=64,k=64,wdtype=f32", "--budget", "nan", "--db", str(tmp_path / "x.json")]
    )
    assert "--budget nan: not a number of seconds" in _one_line_error(r)
    with pytest.raises(CompileError, match="not a number of seconds"):
        tune("cpu", [SHAPE], TuningDB(tmp_path / "y.json", "cpu", []), budget_s=float("nan"), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_shape_too_big_for_memory_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    db = tmp_path / "x.json"
    started = time.monotonic()
    r = CliRunner().invoke(main, ["tune", "--shape", "gemm:n=100000,k=100000,wdtype=f32", "--db", str(db)])
    error = _one_line_error(r)
    assert "gemm" in error and "bytes" in error and "available" in error, error
    assert time.monotonic() - started < 10 and not db.exists()
    # the bound is this machine's available memory: a shape that fits one machine is refused on a smaller one
    monkeypatch.setattr(tuner, "mem_available_bytes", lambda: 100 << 20)
    with pytest.raises(CompileError, match=r"n4096_k4096.*\d+ bytes"):
        tune("cpu", [parse_shape("gemm:n=4096,k=4096,wdtype=f32")], TuningDB(db, "cpu", []), progress=False)
    with pytest.raises(CompileError, match="positive integer"):
        tune("cpu", [parse_shape("gemm:n=x,k=64,wdtype=f32")], TuningDB(db, "cpu", []), progress=False)


def test_a_tuning_database_named_explicitly_must_exist(checkpoint_dir, tmp_path):
    """Only the target's own database may be absent (compile then takes the defaults); a path given is an error."""
    with pytest.raises(CompileError, match="typo.json: no such file"):
        compile_checkpoint(
            checkpoint_dir("llama"), target="cpu", output=tmp_path / "out", tuning_db=tmp_path / "typo.json"
        )
    assert list(tmp_path.iterdir()) == []
    assert TuningDB.load(tmp_path / "absent.json", "cpu").entries == []  # the default's reading: absent is empty
