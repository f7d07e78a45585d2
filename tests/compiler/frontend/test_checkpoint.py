"""What load_checkpoint takes from the files around the weights: generation_config.json and the chat template."""

import json
import shutil

from llmc.compiler.frontend.checkpoint import generation_defaults
from llmc.compiler.frontend.load import load_checkpoint


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
