"""Every byte-level BPE pre-tokenizer llmc imports from a GGUF file (tokenizer.ggml.pre) tokenizes as llama.cpp does.

The vocabulary is a byte-level BPE learned from TRAINING with no split before the merges, so its merges cross the
pre-tokenizers' boundaries and each split shows in the ids; one more token, "Ġcomment", no merge makes: only a
pre-tokenizer that looks a pre-token up whole (ignore_merges) gives it. llama.cpp is not installed in CI: the
vocabulary and llama.cpp's ids for TEXT are recorded in data/gguf_pretokenizer_ids.json (`python -m
tests.compiler.frontend.test_gguf_pretokenizers` records them again), and checked against llama.cpp where it is.
"""

import json
import tempfile
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from llmc.compiler.frontend import gguf_names as names
from llmc.compiler.frontend.gguf_tokenizer import _PRE
from llmc.compiler.frontend.gguf_write import write_gguf
from llmc.compiler.frontend.load import load_checkpoint
from llmc.errors import UnsupportedModelError
from tests.checkpoints import VOCAB, make_checkpoint
from tests.compiler.frontend.test_gguf import _rewrite

DATA = Path(__file__).parent / "data" / "gguf_pretokenizer_ids.json"
TEXT = (
    "Digits 1, 12, 123, 1234, 1234567 and 3.14159; 2024-01-01 x2 ²³ ٣٤\n\n"
    "  Spaces   and\ttabs\t\there\r\n\n\nend  \n \n"
    "中文字符 日本語のテキスト 한국어 café naïve ÉCOLE École Ünïcødé 😀👍🏽 مرحبا بالعالم नमस्ते दुनिया\u3000全角、。！\n"
    "def f(x):\n    return x**2  # comment\n\nclass A:\n    def g(self):\n        return `x`\n"
    "don't I'LL we've THEY'RE it's Ankara'dan 'quote' CamelCaseWord HTTPServer\n"
    'Punctuation!!! ...?? --- (a)[b]{c} <tag/> "q" ~~~ $$$ @#% ^&* ||| \\\\ // …  ١٢٣٤٥ 98765 ！\u3000！'
)
# TEXT, and what some pre-tokenizers split and others keep whole, often enough to be merged
SNIPPETS = ["\u3000全", "या\u3000", "！\u3000！", "١٢٣٤٥", "1234567", "ÉCOLE", "CamelCaseWord", "HTTPServer", "I'LL"]
SNIPPETS += [" 3.14", "  ١", "x**2", "):\n", "É", "Ünï", "Ankara'dan", "        return", "\r\n", "`x`", " 12"]
TRAINING = [TEXT] * 3 + SNIPPETS * 4 + ["here\r\n\n"] * 4 + ["'dan", "\r\n", "x   y"] * 12
UNMERGED = "Ġcomment"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "llmc_cache"))


@pytest.fixture(scope="module")
def recorded():
    data = json.loads(DATA.read_text())
    assert data["text"] == TEXT, (
        "TEXT changed: record again (python -m tests.compiler.frontend.test_gguf_pretokenizers)"
    )
    return {**data, "ids": {pre: ids for pres, ids in data["ids"] for pre in pres}}


@pytest.fixture(scope="module")
def base_file(checkpoint_dir, tmp_path_factory):
    return write_gguf(checkpoint_dir("llama"), tmp_path_factory.mktemp("pre") / "llama.gguf", "F32")


def _file(base: Path, pre: str, vocab: dict, out: Path) -> Path:
    """`base` with the recorded vocabulary and `pre`, and no add_bos key: BOS as the pre-tokenizer's default."""
    tokens, v = vocab["tokens"], gguf.GGUFValueType
    types = [names.TOKEN_CONTROL] * 2 + [names.TOKEN_NORMAL] * (len(tokens) - 2)
    meta = {
        names.TOKENS: (tokens, v.ARRAY, v.STRING),
        names.TOKEN_TYPE: (types, v.ARRAY, v.INT32),
        names.MERGES: (vocab["merges"], v.ARRAY, v.STRING),
        names.TOKENIZER_PRE: (pre, v.STRING, None),
        names.ADD_BOS: None,
    }
    return _rewrite(base, out, None, meta=meta)


def _ours(path: Path) -> list[int]:
    return Tokenizer.from_file(str(load_checkpoint(path).tokenizer_path)).encode(TEXT).ids


def _llama_cpp(llama_cpp, path: Path) -> list[int]:
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return vocab.tokenize(TEXT.encode(), add_bos=True, special=True)


def test_every_pre_tokenizer_is_recorded(recorded):
    assert sorted(recorded["ids"]) == sorted(_PRE)


@pytest.mark.parametrize("pre", sorted(_PRE))
def test_tokenizes_as_llama_cpp_recorded(pre, recorded, base_file, tmp_path):
    assert _ours(_file(base_file, pre, recorded, tmp_path / "pre.gguf")) == recorded["ids"][pre]


@pytest.mark.parametrize("pre", sorted(_PRE))
def test_tokenizes_as_llama_cpp_runs(pre, recorded, base_file, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = _file(base_file, pre, recorded, tmp_path / "pre.gguf")
    theirs = _llama_cpp(llama_cpp, path)
    assert theirs == recorded["ids"][pre], "llama.cpp tokenizes otherwise than recorded: record again"
    assert _ours(path) == theirs


def test_the_text_tells_the_settings_apart(recorded):
    """Pre strings set up differently get different ids, so each row of the table is checked; but bailingmoe's
    regex splits as Qwen2's does (its '\\s*[\\r\\n]' ends where '\\s*[\\r\\n]+' does)."""
    ids = {repr(setting): tuple(recorded["ids"][pre]) for pre, setting in _PRE.items()}
    assert len(set(ids.values())) == len(ids) - 1
    assert recorded["ids"]["bailingmoe"] == recorded["ids"]["qwen2"]


@pytest.mark.parametrize("pre", ["no-such-pre", "gemma4", "roberta-bpe"])
def test_an_unknown_pre_tokenizer_is_refused_in_one_line(pre, recorded, base_file, tmp_path):
    path = _file(base_file, pre, recorded, tmp_path / "pre.gguf")
    with pytest.raises(UnsupportedModelError, match=f"GGUF pre-tokenizer '{pre}' is not supported") as error:
        load_checkpoint(path)
    assert "\n" not in str(error.value)


def _train() -> dict:
    from tokenizers import models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert UNMERGED not in tokens
    return {"tokens": [*tokens, UNMERGED], "merges": [" ".join(m) for m in model["merges"]]}


def _record() -> None:
    """Train the vocabulary and write it to DATA with llama.cpp's ids for TEXT under each pre-tokenizer."""
    import llama_cpp

    vocab = _train()
    with tempfile.TemporaryDirectory() as tmp:
        base = write_gguf(make_checkpoint(Path(tmp) / "ckpt", "llama"), Path(tmp) / "base.gguf", "F32")
        ids = {pre: _llama_cpp(llama_cpp, _file(base, pre, vocab, Path(tmp) / "pre.gguf")) for pre in sorted(_PRE)}
    alike: dict[tuple, list[str]] = {}  # pre strings with the same ids, recorded once
    for pre, i in ids.items():
        alike.setdefault(tuple(i), []).append(pre)
    rows = ",\n".join(f"  [{json.dumps(pres)}, {json.dumps(i, separators=(',', ':'))}]" for i, pres in alike.items())
    head = "".join(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},\n" for k, v in vocab.items())
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(f'{{\n "text": {json.dumps(TEXT, ensure_ascii=False)},\n{head} "ids": [\n{rows}\n ]\n}}\n')


if __name__ == "__main__":
    _record()
