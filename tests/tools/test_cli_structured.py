"""`llmc run --json-schema / --regex / --choice / --grammar` on the bundled model: the output matches, and a bad
constraint or a file that is not one is a one-line error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from click.testing import CliRunner

from llmc.examples import bundled_checkpoint
from llmc.tools import cli
from llmc.tools.build import cached_artifact


@pytest.fixture(scope="module")
def artifact():
    return cached_artifact(bundled_checkpoint(), progress=False)


def run(artifact, *args):
    return CliRunner().invoke(cli.main, ["run", str(artifact), "--prompt", "The list type", "--json", *map(str, args)])


def test_json_schema(artifact, tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
              "required": ["name", "n"]}  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(schema))
    result = run(artifact, "--json-schema", tmp_path / "s.json", "--max-tokens", 100)
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(json.loads(result.stdout)["text"]), schema)


@pytest.mark.parametrize(
    "args, check",
    [
        (["--regex", r"[0-9]{3}-[a-z]{2}"], lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (["--choice", "list", "--choice", "tuple"], lambda t: t in ("list", "tuple")),
    ],
)
def test_regex_and_choice(artifact, args, check):
    result = run(artifact, *args, "--temperature", 0.8, "--seed", 3)
    assert result.exit_code == 0, result.output
    assert check(json.loads(result.stdout)["text"])


def test_grammar_file(artifact, tmp_path):
    (tmp_path / "g.lark").write_text('start: "def " NAME "():"\nNAME: /[a-z_]{1,10}/\n')
    result = run(artifact, "--grammar", tmp_path / "g.lark")
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"def [a-z_]{1,10}\(\):", json.loads(result.stdout)["text"])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--regex", "[a-"], "regex constraint cannot be compiled"),
        (["--regex", "a", "--choice", "a"], "give one of"),
        (["--json-schema", "NOT_JSON"], "not JSON"),
        (["--grammar", "BINARY"], "not UTF-8"),
        (["--grammar", "EMPTY_RULE"], "grammar constraint cannot be compiled"),
    ],
)
def test_bad_constraints_are_one_line_errors(artifact, tmp_path, args, words):
    (tmp_path / "NOT_JSON").write_text("{nope")
    (tmp_path / "BINARY").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "EMPTY_RULE").write_text("start: missing_rule\n")
    args = [str(tmp_path / a) if a.isupper() else a for a in args]
    result = run(artifact, *args)
    assert result.exit_code == 1 and words in result.stderr and result.stderr.count("\n") == 1, result.output
