import pytest

from llmc.runtime.detokenizer import IncrementalDetokenizer
from tests.runtime.runtime_fakes import byte_level_bpe, sentencepiece_bpe


@pytest.fixture(scope="module")
def bbpe():
    return byte_level_bpe()


def stream(tok, prompt_ids, output_ids, stop=(), finish_at_end=True):
    """Feed output tokens one at a time; return (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=stop)
    deltas = []
    for i, t in enumerate(output_ids):
        last = finish_at_end and i == len(output_ids) - 1
        matched = detok.update([t], flush=last)
        deltas.append(detok.take_delta(finished=last or matched is not None))
        if matched is not None:
            break
    return deltas, detok


def test_multibyte_characters_split_across_byte_tokens(bbpe):
    text = "café 日本 🙂 déjà 🚀!"
    ids = bbpe.encode(text).ids
    assert any("\ufffd" in bbpe.decode([i]) for i in ids), "the test needs characters split across tokens"
    prompt = bbpe.encode("hello ").ids
    deltas, detok = stream(bbpe, prompt, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == text == bbpe.decode(ids)
    assert "" in deltas  # some tokens were held back: their character was not complete yet


def test_held_back_partial_character_is_flushed_at_the_end(bbpe):
    ids = bbpe.encode("ok 🚀").ids
    cut = ids[:-1]  # the rocket's last byte never arrives
    assert bbpe.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(bbpe, [])
    for t in cut:
        detok.update([t])
    sent = detok.take_delta()
    assert sent in ("ok", "ok ")  # the space may share a token with the rocket's first byte
    detok.update([], flush=True)
    assert sent + detok.take_delta(finished=True) == bbpe.decode(cut)


def test_sentencepiece_leading_spaces_survive_window_decoding():
    sp = sentencepiece_bpe()
    prompt = sp.encode("hello world").ids
    output = sp.encode("the quick brown fox").ids
    assert sp.decode(output[1:2]) == sp.decode(output[1:2]).lstrip(), "decoding a window alone strips its space"
    deltas, detok = stream(sp, prompt, output)
    full = sp.decode(prompt + output)
    assert "".join(deltas) == full[len(sp.decode(prompt)) :] == " the quick brown fox"


def test_stop_string_spanning_tokens_truncates_and_is_never_streamed(bbpe):
    text = "the quick brown fox jumps over the lazy dog"
    ids = bbpe.encode(text).ids
    stop = "n fox j"  # spans several tokens
    deltas, detok = stream(bbpe, [], ids, stop=[stop, "never"])
    assert detok.stop_reason == stop
    assert detok.output_text == "the quick brow"
    assert "".join(deltas) == "the quick brow"
    for i in range(len(deltas)):  # no prefix of the stop string ever left early
        assert stop[:2] not in "".join(deltas[: i + 1])


def test_partial_stop_prefix_is_held_back_then_released(bbpe):
    detok = IncrementalDetokenizer(bbpe, [], stop=["xyz"])
    detok.update(bbpe.encode("abc x").ids)
    assert detok.take_delta() == "abc "  # " x" could start "xyz": "x" held
    detok.update(bbpe.encode("y").ids)
    assert detok.take_delta() == ""  # "xy" still could
    detok.update(bbpe.encode("a").ids)
    assert detok.take_delta() == "xya"  # it did not: released
    assert detok.stop_reason is None


def test_earliest_stop_string_wins_and_multibyte_stop(bbpe):
    ids = bbpe.encode("naïve café déjà vu").ids
    _, detok = stream(bbpe, [], ids, stop=["déjà", "é"])
    assert detok.stop_reason == "é" and detok.output_text == "naïve caf"
    _, detok = stream(bbpe, [], ids, stop=["déjà"])
    assert detok.stop_reason == "déjà" and detok.output_text == "naïve café "


def test_check_stop_off_ignores_stop_strings(bbpe):
    detok = IncrementalDetokenizer(bbpe, [], stop=["fox"])
    assert detok.update(bbpe.encode("the fox").ids, check_stop=False) is None
    assert detok.output_text == "the fox"
