"""`--simulate` rebuilds a CUDA artifact's model.cu with g++. The artifact carries the device headers that
model.cu was rendered against, so that build is of what was compiled, whichever llmc is installed. An older
artifact carries none: when its model.cu no longer builds against this llmc's headers, that is an
ArtifactError that says to recompile, not a page of g++ errors."""

import json
import shutil

import pytest

from llmc.compiler.codegen import simulator
from llmc.compiler.codegen.render import target_headers
from llmc.compiler.compile import compile_checkpoint
from llmc.digests import file_sha256
from llmc.errors import ArtifactError
from llmc.manifest import read_manifest, seal_manifest
from llmc.runtime.module import CompiledModel


@pytest.fixture(scope="module")
def sm90(checkpoint_dir, tmp_path_factory):
    return compile_checkpoint(checkpoint_dir("llama"), target="sm90", output=tmp_path_factory.mktemp("a") / "m.sm90")


def _edit(artifact, out, *, drop_headers=False, append_to_source=""):
    """A copy of the artifact with its manifest resealed, as the compiler of that copy would have written it."""
    shutil.copytree(artifact, out)
    m = json.loads((out / "manifest.json").read_text())
    if drop_headers:
        for name in target_headers("cuda"):
            (out / name).unlink()
            del m["files"][name]
    with open(out / "model.cu", "a") as f:
        f.write(append_to_source)
    m["files"]["model.cu"] = file_sha256(out / "model.cu")
    (out / "manifest.json").write_text(json.dumps(seal_manifest(m)))
    return out


def test_a_cuda_artifact_carries_the_headers_of_its_source(sm90):
    files = read_manifest(sm90)["files"]
    for name, text in target_headers("cuda").items():
        assert name in files and (sm90 / name).read_text() == text


def test_it_simulates_against_its_own_headers_not_the_installed_ones(sm90, tmp_path, monkeypatch):
    (tmp_path / "moved").mkdir()
    monkeypatch.setattr(simulator, "INCLUDE_DIR", tmp_path / "moved")  # this llmc's headers: none of them
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))  # a build, not a cached library
    lib = simulator.build_simulated_library(sm90)
    with CompiledModel.load(sm90, library=lib, kv_cache_memory="8MiB") as model:
        assert model.config.num_layers >= 1


def test_an_old_artifact_that_no_longer_builds_says_to_recompile(sm90, tmp_path):
    old = _edit(
        sm90,
        tmp_path / "old.sm90",
        drop_headers=True,
        append_to_source='\nstatic_assert(llmc::kContractOfAnotherRelease, "");\n',
    )
    with pytest.raises(ArtifactError, match=r"does not build against this llmc's CUDA headers.*recompile it"):
        simulator.build_simulated_library(old)
    with pytest.raises(ArtifactError, match=r"recompile it"):
        simulator.build_profiled_library(old)


def test_an_old_artifact_that_still_builds_runs(sm90, tmp_path):
    old = _edit(sm90, tmp_path / "old.sm90", drop_headers=True)
    with CompiledModel.load(old, library=simulator.build_simulated_library(old), kv_cache_memory="8MiB"):
        pass
