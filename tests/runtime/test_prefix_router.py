"""prefix_router.PrefixAffinity's choices over fake replica loads, and the routing text of request bodies; no Ray."""

import json
import random

import pytest

from llmc.runtime.prefix_router import PrefixAffinity, routing_prompt


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefgh ") for _ in range(n))


def test_balanced_load_follows_the_longest_matching_prefix():
    rng = random.Random(0)
    router = PrefixAffinity(rng=random.Random(1))
    system_a, system_b = _random_text(rng, 137), _random_text(rng, 211)
    router.record(system_a + "first question", "r1")
    router.record(system_b + "other question", "r2")
    router.record(system_a[:50], "r3")  # shares only a shorter prefix with later system_a prompts
    loads = {"r1": 2, "r2": 0, "r3": 1}
    assert router.choose(system_a + _random_text(rng, 23), loads)[0] == ["r1"]
    assert router.choose(system_b + _random_text(rng, 31), loads)[0] == ["r2"]
    assert router.choose(system_a[:70] + "zzzz", loads)[0] == ["r1"]  # r1's path is longer past 50 characters


def test_the_most_recent_replica_wins_a_tie():
    router = PrefixAffinity(rng=random.Random(0))
    router.record("shared prompt, then r1", "r1")
    router.record("shared prompt, then r2", "r2")
    assert router.choose("shared prompt, then", {"r1": 0, "r2": 0})[0] == ["r2"]


def test_after_the_affine_replica_come_two_random_others_least_loaded_first():
    router = PrefixAffinity(rng=random.Random(3))
    router.record("a long shared prefix of a prompt", "r0")
    loads = {"r0": 1, "r1": 4, "r2": 0, "r3": 2}
    first, second = router.choose("a long shared prefix of a prompt 2", loads)
    assert first == ["r0"]
    assert len(second) == 2 and "r0" not in second and loads[second[0]] <= loads[second[1]]


def test_imbalanced_load_falls_back_to_the_power_of_two_choices():
    router = PrefixAffinity(imbalance=3, rng=random.Random(5))
    router.record("prompt served by r1", "r1")
    loads = {"r1": 9, "r2": 1, "r3": 5}
    for _ in range(50):
        (pair,) = router.choose("prompt served by r1 again", loads)
        assert len(pair) == 2 and loads[pair[0]] <= loads[pair[1]]
        assert pair[0] != "r1"  # the busiest replica is never first of two


def test_a_short_match_does_not_count():
    """A match under min_match_fraction of the prompt (a shared opening word) says nothing about the cache."""
    router = PrefixAffinity(min_match_fraction=0.5, rng=random.Random(0))
    router.record("The list type is mutable", "r1")
    for _ in range(20):  # a random pair, never the lone affine replica
        assert len(router.choose("The cat sat on the mat, and more words", {"r1": 0, "r2": 0})[0]) == 2


def test_replicas_not_among_the_candidates_and_forgotten_ones_are_not_chosen():
    router = PrefixAffinity(rng=random.Random(0))
    router.record("prompt of a replica that died", "dead")
    router.record("prompt of a replica that died, shorter", "alive")
    assert router.choose("prompt of a replica that died", {"alive": 0, "other": 0})[0] == ["alive"]
    router.forget("alive")
    assert router.longest_match("prompt of a replica that died", {"alive", "other"}) == (None, 0)


def test_old_records_are_forgotten_past_max_records():
    router = PrefixAffinity(max_records=3, rng=random.Random(0))
    for i, replica in enumerate(["r1", "r2", "r3", "r4"]):
        router.record(f"prompt number {i}", replica)
    assert router.longest_match("prompt number 0", {"r1"}) == (None, 0)
    assert router.longest_match("prompt number 3", {"r4"}) == ("r4", len("prompt number 3"))


def test_no_candidates_no_choice():
    assert PrefixAffinity().choose("x", {}) == []


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/completions", {"prompt": "hello"}, "hello"),
        ("/v1/completions", {"prompt": ["hello"]}, "hello"),
        ("/v1/completions", {"prompt": [5, 17, 3]}, "5,17,3,"),
        ("/v1/completions", {"prompt": 3}, ""),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                ]
            },
            "system\x1fbe brief\x1euser\x1fhi\x1e",
        ),
        ("/v1/models", None, ""),
    ],
)
def test_routing_prompt(path, body, expected):
    assert routing_prompt(path, b"" if body is None else json.dumps(body).encode()) == expected


def test_routing_prompt_of_a_bad_body_is_empty():
    assert routing_prompt("/v1/completions", b"{not json") == ""
    assert routing_prompt("/v1/completions", b"\xff\xfe") == ""
    assert routing_prompt("/v1/chat/completions", b"[1, 2]") == ""


def test_chats_sharing_their_history_share_a_prefix():
    history = [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"}]
    first = routing_prompt("/v1/chat/completions", json.dumps({"messages": history}).encode())
    longer = {"messages": history + [{"role": "user", "content": "a follow-up"}]}
    assert routing_prompt("/v1/chat/completions", json.dumps(longer).encode()).startswith(first)
