"""llmc/artifact.py, artifact_writer.py and manifest.py: atomic writes, hash checks (files and the manifest's own
fields), version and target checks."""

import json
import os

import pytest

from llmc import __version__, digests
from llmc import artifact as art
from llmc import artifact_writer as writer
from llmc import manifest as mf
from llmc.compiler.frontend.load import load_checkpoint
from llmc.errors import ArtifactError
from llmc.host import host_caches, host_cpu_isa


@pytest.fixture(scope="module")
def config(checkpoint_dir):
    return load_checkpoint(checkpoint_dir("llama")).config


def _populate(config, target="cpu", fail=False):
    def populate(tmp):
        (tmp / "model.so").write_bytes(b"\x7fELF not really")
        (tmp / ("model.cu" if target != "cpu" else "model.cc")).write_text("// generated\n")
        (tmp / "weights.safetensors").write_bytes(b"w" * 100)
        (tmp / "tokenizer.json").write_text("{}")
        if fail:
            raise RuntimeError("populate failed half-way")
        return {
            "target": {"name": target, "cflags": ["-O3"]},
            "model_config": config,
            "weight_dtype": "float32",
            "kernels": [{"id": "k0", "template": "rmsnorm", "params": {"hidden": 64}, "tuning_source": "default"}],
            "passes": {"fuse_rmsnorm": 3, "fuse_rope": 0},
            "buffer_plan": {"bytes": 4096},
            "tokenizer": {"chat_template": "{{x}}", "bos_token": "<s>", "eos_token": "</s>"},
        }

    return populate


def _rewrite_manifest(path, *, seal=True, **changes):
    """Change top-level fields; sealed, as a compiler elsewhere would have written them (not an edit)."""
    m = json.loads((path / "manifest.json").read_text())
    m.update(changes)
    (path / "manifest.json").write_text(json.dumps(mf.seal_manifest(m) if seal else m))


def test_write_and_load(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cpu"], "no temporary dir may stay behind"
    m = json.loads((out / "manifest.json").read_text())
    assert (
        m["magic"] == "llmc-artifact"
        and m["format_version"] == mf.FORMAT_VERSION
        and m["abi_version"] == mf.ABI_VERSION
    )
    assert m["compiler_version"] == __version__ and m["quantization"] == "none"
    assert m["target"]["name"] == "cpu" and m["target"]["cflags"] == ["-O3"] and m["target"]["kind"] == "cpu"
    assert m["target"]["isa"] == host_cpu_isa(), "a cpu target records this host's ISA"
    assert m["block_size"] == 16, "the block size defaults to the target's (targets/cpu.toml)"
    assert set(m["files"]) == {"model.so", "model.cc", "weights.safetensors", "tokenizer.json"}
    a = art.load_artifact(out)
    assert a.config == config and a.chat_template == "{{x}}" and a.eos_token == "</s>"
    assert a.library_path == out / "model.so" and a.source_path == out / "model.cc"


def test_failed_populate_leaves_nothing(tmp_path, config):
    with pytest.raises(RuntimeError, match="half-way"):
        writer.write_artifact(tmp_path / "a.cpu", _populate(config, fail=True))
    assert list(tmp_path.iterdir()) == []


def test_failed_rewrite_keeps_the_old_artifact(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    before = (out / "manifest.json").read_text()
    with pytest.raises(RuntimeError):
        writer.write_artifact(out, _populate(config, fail=True))
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cpu"]


def test_replace_existing_artifact(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    (out / "stale.txt").write_text("old")
    writer.write_artifact(out, _populate(config))
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cpu"]
    art.load_artifact(out)


def test_refuses_to_replace_a_non_artifact(tmp_path, config):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not an llmc artifact"):
        writer.write_artifact(tmp_path / "mine", _populate(config))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("name", ["weights.safetensors", "model.so", "model.cc", "tokenizer.json"])
def test_corrupt_file_is_named(tmp_path, config, name):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    with open(out / name, "r+b") as f:
        f.write(b"X")
    with pytest.raises(ArtifactError, match=rf"{name} is corrupt.*recompile"):
        art.load_artifact(out)
    art.load_artifact(out, verify=False)  # the simulator and the profiler, which verify right after, still read it


def test_missing_file_is_named(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    os.remove(out / "weights.safetensors")
    with pytest.raises(ArtifactError, match="weights.safetensors is missing"):
        art.load_artifact(out)


@pytest.mark.parametrize("key", ["format_version", "abi_version"])
def test_version_mismatch(tmp_path, config, key):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    _rewrite_manifest(out, **{key: 99})
    want = {"format_version": mf.FORMAT_VERSION, "abi_version": mf.ABI_VERSION}[key]
    with pytest.raises(
        ArtifactError,
        match=rf"{key.replace('_', ' ')} 99.*reads version {want}.*llmc compile CHECKPOINT --target cpu -o",
    ):
        art.load_artifact(out)


def test_not_an_artifact(tmp_path, checkpoint_dir):
    with pytest.raises(ArtifactError, match="no such artifact"):
        art.load_artifact(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="no manifest.json"):
        art.load_artifact(tmp_path / "empty")
    with pytest.raises(ArtifactError, match="is a checkpoint.*llmc compile"):
        art.load_artifact(checkpoint_dir("llama"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupt manifest"):
        art.load_artifact(tmp_path / "bad")
    (tmp_path / "bad" / "manifest.json").write_text('{"magic": "other"}')
    with pytest.raises(ArtifactError, match="not an llmc artifact manifest"):
        art.load_artifact(tmp_path / "bad")


def test_cpu_isa_mismatch(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    m = json.loads((out / "manifest.json").read_text())
    _rewrite_manifest(out, target={**m["target"], "isa": m["target"]["isa"] + ["avx9000_quantum"]})
    with pytest.raises(ArtifactError, match="built for another CPU.*avx9000_quantum.*recompile"):
        art.load_artifact(out)
    art.load_artifact(out, check_target=False)
    _rewrite_manifest(out, target={**m["target"], "machine": "vax"})
    with pytest.raises(ArtifactError, match=r"built for another CPU \(vax"):
        art.load_artifact(out)


def test_host_cpu_isa_parses_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 sse4_1 avx avx2 hypervisor avx512f fma tsc\n\n")
    assert host_cpu_isa(str(info)) == ["avx", "avx2", "avx512f", "fma", "sse", "sse2", "sse4_1"]
    info.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve\n")
    assert host_cpu_isa(str(info)) == ["aes", "asimd", "sve"]
    assert host_cpu_isa(str(tmp_path / "none")) == []


def test_host_caches_parse_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (3, "Unified", "491520K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    (tmp_path / "index3").mkdir()  # unreadable entries are skipped
    assert [c["bytes"] for c in host_caches(str(tmp_path))] == [48 << 10, 32 << 10, 480 << 20]
    assert host_caches(str(tmp_path / "none")) == []


def test_cuda_target_manifest(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.sm90", _populate(config, target="sm90"))
    a = art.load_artifact(out)
    assert a.is_cuda and a.source_path.name == "model.cu" and "isa" not in a.target


def test_unknown_target(tmp_path, config):
    pop = _populate(config)

    def bad(tmp):
        return {**pop(tmp), "target": {"name": "tpu"}}

    with pytest.raises(ArtifactError, match="tpu"):
        writer.write_artifact(tmp_path / "a", bad)
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_hash(tmp_path, checkpoint_dir):
    import shutil

    src = checkpoint_dir("mistral")  # sharded
    h = digests.checkpoint_hash(src)
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    assert digests.checkpoint_hash(copy) == h, "the hash depends on contents, not on the path"
    shard = sorted(copy.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    assert digests.checkpoint_hash(copy) != h


def test_big_file_digests_are_remembered_across_renames(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "a" / "weights.bin"
    f.parent.mkdir()
    f.write_bytes(os.urandom(260 << 20))
    digest = digests.file_sha256(f)
    moved = tmp_path / "b"
    os.rename(f.parent, moved)  # an artifact renamed into place keeps its files' identity
    digests._memory.clear()  # as a new process would see it: only the on-disk store
    assert digests.known_sha256(moved / "weights.bin") == digest
    with open(moved / "weights.bin", "r+b") as fh:  # a rewrite changes the identity: hashed again
        fh.write(b"x" * 16)
    assert digests.known_sha256(moved / "weights.bin") is None
    assert digests.file_sha256(moved / "weights.bin") != digest


@pytest.mark.parametrize(
    "field, edit",
    [
        ("model_config", lambda m: m["model_config"].update(max_position_embeddings=1 << 20)),
        ("model_config", lambda m: m["model_config"].update(hidden_size=m["model_config"]["hidden_size"] * 2)),
        ("block_size", lambda m: m.update(block_size=32)),
        ("tokenizer", lambda m: m["tokenizer"].update(eos_token="<s>")),
        ("generation_defaults", lambda m: m.update(generation_defaults={"temperature": 0.7})),
        ("files", lambda m: m["files"].update({"model.so": "0" * 64})),
    ],
)
def test_edited_manifest_is_refused_naming_the_field(tmp_path, config, field, edit):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    m = json.loads((out / "manifest.json").read_text())
    edit(m)
    (out / "manifest.json").write_text(json.dumps(m, indent=1))
    with pytest.raises(ArtifactError, match=rf"manifest.json: field {field} was edited or damaged.*recompile"):
        art.load_artifact(out)


def test_manifest_without_its_digests_is_refused(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    m = json.loads((out / "manifest.json").read_text())
    del m["manifest_sha256"]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="manifest.json: no manifest_sha256"):
        art.load_artifact(out)


def test_manifest_reformatted_is_accepted(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(dict(reversed(m.items())), indent=None))  # same content
    assert art.load_artifact(out).config == config


def test_target_kind_comes_from_the_manifest_not_the_name(tmp_path, config):
    """A target the reader has never heard of loads by the kind its manifest records."""
    pop = _populate(config, target="sm120x")

    def custom(tmp):
        return {
            **pop(tmp),
            "target": {"name": "sm120x", "kind": "cuda", "gencode": "arch=compute_120,code=sm_120"},
            "block_size": 8,
        }

    a = art.load_artifact(writer.write_artifact(tmp_path / "a.sm120x", custom))
    assert a.is_cuda and a.kind == "cuda" and a.source_path.name == "model.cu" and a.block_size == 8
    _rewrite_manifest(a.path, target={"name": "sm120x"})
    with pytest.raises(ArtifactError, match="manifest target.*no kind"):
        art.load_artifact(a.path)


def test_block_size_is_required(tmp_path, config):
    out = writer.write_artifact(tmp_path / "a.cpu", _populate(config))
    _rewrite_manifest(out, block_size=None)
    with pytest.raises(ArtifactError, match="block_size None is not a positive integer"):
        art.load_artifact(out)
