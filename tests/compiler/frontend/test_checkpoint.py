"""What load_checkpoint takes from the files around the weights: generation_config.json and the chat template."""

import json
import shutil

import pytest

from llmc.compiler.frontend.checkpoint import generation_defaults
from llmc.compiler.frontend.load import load_checkpoint
from llmc.errors import CheckpointError


def _copy(checkpoint_dir, tmp_path):
    return shutil.copytree(checkpoint_dir("llama"), tmp_path / "ckpt")


def test_generation_defaults_follow_do_sample():
    assert generation_defaults({}) == {}
    assert generation_defaults({"do_sample": False, "temperature": 0.6}) == {"temperature": 0.0}
    assert generation_defaults({"do_sample": True, "temperature": 0.6, "top_k": 40, "top_p": None}) == {
        "temperature": 0.6,
        "top_k": 40,
    }
    assert generation_defaults({"do_sample": True}) == {"temperature": 1.0}


def test_generation_config_eos_ids_win_over_config_json(checkpoint_dir, tmp_path):
    # Llama-3 and Qwen2 instruct checkpoints list their end-of-turn tokens only in generation_config.json
    path = _copy(checkpoint_dir, tmp_path)
    assert load_checkpoint(path).config.eos_token_ids == (1,)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7], "do_sample": False}))
    assert load_checkpoint(path).config.eos_token_ids == (1, 7)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_checkpoint(path).config.eos_token_ids == (9,)
    (path / "generation_config.json").unlink()
    assert load_checkpoint(path).config.eos_token_ids == (1,)


def test_chat_template_file_wins_over_tokenizer_config(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir, tmp_path)
    assert "add_generation_prompt" in load_checkpoint(path).chat_template
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_checkpoint(path).chat_template == "{{ messages[0]['content'] }}"


# Gemma's template refuses a system turn; the other sample conversations render
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ 'a' * 1000000000 }}", "asks for 1,000,000,000 characters"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than"),
        ("{{ raise_exception('no conversation suits me') }}", "rendered none of .* no conversation suits me"),
        ("{% for %}", "does not parse"),
    ],
    ids=["too large", "too slow", "renders nothing", "broken"],
)
def test_a_chat_template_that_could_not_serve_is_refused_at_load(checkpoint_dir, tmp_path, template, match):
    path = _copy(checkpoint_dir, tmp_path)
    (path / "chat_template.jinja").write_text(template)
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(path)
    assert "chat_template.jinja" in str(e.value) and "\n" not in str(e.value)


def test_a_template_that_refuses_a_system_turn_is_kept(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir, tmp_path)
    (path / "chat_template.jinja").write_text(GEMMA)
    assert load_checkpoint(path).chat_template == GEMMA
