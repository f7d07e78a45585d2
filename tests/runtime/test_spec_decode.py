"""Speculative decoding changes no greedy output and keeps the target's distribution when sampling.

Greedy: with n-gram guesses, and with an oracle proposer that guesses right except where the test corrupts it,
every request's tokens equal the non-speculative (and cacheless) reference, batched, with random arrivals,
prefix caching and a cache small enough to preempt, on the fake model and on a compiled module. Sampled: the
rejection-sampling function keeps the target distribution (chi-square over many seeded draws).
"""

import numpy as np
import pytest
import torch

from llmc.compiler.compile import compile_checkpoint
from llmc.errors import LlmcError
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.runtime.spec_decode import Proposal, SpeculativeConfig, accept_greedy, ngram_lookup, rejection_sample
from llmc.sampling_params import SamplingParams
from tests.runtime.runtime_fakes import (
    FakeConfig,
    FakeModel,
    byte_level_bpe,
    context_logits,
    reference_greedy,
    run_with_arrivals,
)

NGRAM = SpeculativeConfig("ngram", 4)


# -- n-gram lookup and greedy acceptance ------------------------------------------------------------------


def test_ngram_lookup_copies_what_followed_the_longest_latest_match():
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # "6 7" occurs at 1-2 and 6-7; the latest wins
    assert ngram_lookup(tokens, 3) == [2, 3, 6]
    # "5 6 7" is longer than "6 7" and wins although older
    assert ngram_lookup([5, 6, 7, 8, 9, 4, 6, 7, 2, 5, 6, 7], 2) == [8, 9]
    assert ngram_lookup([1, 2, 3], 4) == []  # 3 never occurred before
    assert ngram_lookup([1, 2, 3], 4, ngram_min=2) == []
    assert ngram_lookup([4, 4, 4, 4], 3) == [4]  # only one token follows the latest match
    assert ngram_lookup([7], 3) == []
    assert ngram_lookup([1, 2, 3, 1, 2], 5, ngram_max=1) == [3, 1, 2]  # only "2" is looked up


def test_accept_greedy_stops_at_the_first_disagreement_and_keeps_the_targets_token():
    assert accept_greedy([4, 5, 6].__getitem__, [4, 5]) == [4, 5, 6]  # all accepted, plus the bonus token
    assert accept_greedy([4, 9, 6].__getitem__, [4, 5]) == [4, 9]
    assert accept_greedy([3, 5, 6].__getitem__, [4, 5]) == [3]


# -- greedy equivalence, fake model ------------------------------------------------------------------------


class OracleProposer:
    """Guesses the true greedy continuation (reference_greedy), with each guess replaced by a wrong token with
    probability `error_rate`, so runs of every length are accepted and rejected."""

    def __init__(self, config: FakeConfig, error_rate: float, seed: int):
        self.config, self.error_rate, self.rng = config, error_rate, np.random.default_rng(seed)
        self.freed: list[str] = []

    def propose(self, requests):
        out = []
        for r in requests:
            context = list(r.token_ids)
            guesses = []
            for _ in range(r.num_tokens):
                tok = int(np.argmax(context_logits(np.asarray(context), self.config.vocab_size)))
                if self.rng.random() < self.error_rate:
                    tok = (tok + 1) % self.config.vocab_size
                guesses.append(tok)
                context.append(tok)
            out.append(Proposal(guesses))
        return out

    def free(self, seq_id):
        self.freed.append(seq_id)


def workload(seed, num_requests, vocab, ignore_eos):
    rng = np.random.default_rng(seed)
    base = [int(t) for t in rng.integers(2, vocab, 24)]
    requests = []
    for _ in range(num_requests):
        prompt = base[: rng.integers(0, 25)] + [int(t) for t in rng.integers(2, vocab, rng.integers(1, 20))]
        params = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30)), ignore_eos=ignore_eos)
        requests.append((prompt, params))
    return requests, [int(a) for a in rng.integers(0, num_requests, num_requests)]


def spec_engine(config, speculative, proposer=None, **kw):
    model = FakeModel(config, num_blocks=24, block_size=4, max_num_tokens=16, max_num_seqs=6, max_num_logits=30)
    engine = LLMEngine(model, max_num_batched_tokens=16, speculative=speculative, **kw)
    if proposer is not None:
        engine._proposer = proposer
    return engine


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_oracle_guesses_change_no_greedy_output_under_preemption_and_prefix_caching(seed, error_rate):
    config = FakeConfig()
    requests, arrivals = workload(seed, 16, config.vocab_size, ignore_eos=False)
    proposer = OracleProposer(config, error_rate, seed)
    engine = spec_engine(config, SpeculativeConfig("ngram", 3), proposer)
    got = run_with_arrivals(engine, requests, arrivals)
    for i, (prompt, params) in enumerate(requests):
        assert got[i][0] == reference_greedy(prompt, params.max_tokens, config, engine.max_model_len), f"request {i}"
    st = engine.stats()
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens > 0
    if error_rate == 0.0:
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    else:
        assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert engine.scheduler.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert engine.kv_cache.num_free_blocks == 24  # rollbacks and finishes gave every block back
    assert sorted(proposer.freed) == sorted(engine.scheduler.requests.keys() | set(proposer.freed))


def test_oracle_guesses_cut_a_run_at_max_tokens_and_at_eos():
    config = FakeConfig(eos_token_ids=(1,))
    engine = spec_engine(config, SpeculativeConfig("ngram", 8), OracleProposer(config, 0.0, 0))
    rng = np.random.default_rng(5)
    reasons = set()
    for _ in range(40):
        prompt = [int(t) for t in rng.integers(2, 64, 6)]
        for max_tokens in (1, 2, 5):
            out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]
            assert out.token_ids == reference_greedy(prompt, max_tokens, config)
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
        assert out.token_ids == reference_greedy(prompt, 200, config, engine.max_model_len)  # the cache's length
        reasons.add(out.finish_reason)
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize("seed", range(3))
def test_ngram_greedy_with_penalties_min_tokens_and_logprobs_equals_no_speculation(seed):
    config = FakeConfig(vocab_size=12)  # a small vocabulary repeats itself, so n-gram guesses are often right
    rng = np.random.default_rng(seed)
    requests = [
        (
            [int(t) for t in rng.integers(2, 12, rng.integers(2, 30))],
            SamplingParams(
                temperature=0,
                max_tokens=40,
                logprobs=2,
                min_tokens=int(rng.integers(0, 10)),
                repetition_penalty=float(rng.choice([1.0, 1.3])),
                frequency_penalty=float(rng.choice([0.0, 0.2])),
            ),
        )
        for _ in range(8)
    ]
    arrivals = [int(a) for a in rng.integers(0, 6, 8)]
    got = {}
    for speculative in (None, SpeculativeConfig("ngram", 4, ngram_max=3)):
        engine = spec_engine(config, speculative)
        results = {}
        ids = {}
        step = 0
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        while order or engine.has_unfinished():
            while order and arrivals[order[0]] <= step:
                i = order.pop(0)
                ids[engine.add_request(*requests[i])] = i
                results[i] = ([], [])
            for out in engine.step():
                results[ids[out.req_id]][0].extend(out.new_token_ids)
                results[ids[out.req_id]][1].extend(out.logprobs)
            step += 1
        got[speculative is not None] = results, engine.stats()
    assert got[True][0] == got[False][0]
    assert got[True][1].spec_num_accepted_tokens > 0


def test_requests_without_speculation_mix_with_speculating_ones():
    config = FakeConfig(eos_token_ids=(999,))  # no EOS in reach: both run 12 tokens
    proposer = OracleProposer(config, 0.0, 0)
    engine = spec_engine(config, SpeculativeConfig("ngram", 3), proposer)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = engine.add_request([3, 4, 5], params, speculate=False)
    spec = engine.add_request([6, 7, 8], params)
    steps: dict[str, int] = {plain: 0, spec: 0}
    tokens: dict[str, list[int]] = {plain: [], spec: []}
    while engine.has_unfinished():
        for out in engine.step():
            steps[out.req_id] += 1
            tokens[out.req_id].extend(out.new_token_ids)
    assert tokens[plain] == reference_greedy([3, 4, 5], 12, config)
    assert tokens[spec] == reference_greedy([6, 7, 8], 12, config)
    assert steps[plain] == 12 and steps[spec] == 4  # 1 + 4 + 4 + 3 tokens: the prompt, then runs of 3 guesses + 1


def test_speculation_needs_spare_logits_rows():
    model = FakeModel(FakeConfig(), max_num_seqs=4, max_num_logits=4)
    with pytest.raises(LlmcError, match="max_num_logits"):
        LLMEngine(model, speculative=NGRAM)
    with pytest.raises(LlmcError, match="draft"):
        SpeculativeConfig("ngram", 4, draft_model=model)
    with pytest.raises(LlmcError):
        SpeculativeConfig("medusa", 4)


# -- rejection sampling keeps the target distribution ------------------------------------------------------


def chi_square_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=probs.shape[0])
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[support] * len(samples)
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2)))


def random_probs(rng, vocab, zeros=0):
    p = rng.dirichlet(np.ones(vocab))
    p[rng.choice(vocab, zeros, replace=False)] = 0.0
    return p / p.sum()


@pytest.mark.parametrize("draft", ["model", "deterministic"])
def test_rejection_sampling_emits_each_position_from_the_target_distribution(draft):
    """K = 2 over a vocabulary of 5: the first emitted token must follow p0, and the second, given the first
    was the accepted guess, must follow p1 (given it was not, there is no second token)."""
    rng = np.random.default_rng(0)
    vocab, draws = 5, 40_000
    target = np.stack([random_probs(rng, vocab, zeros=1), random_probs(rng, vocab), random_probs(rng, vocab)])
    draft_probs = np.stack([random_probs(rng, vocab), random_probs(rng, vocab, zeros=1)])
    first, second_after_accept, num_tokens = [], [], []
    fixed_guesses = [int(np.argmax(draft_probs[0])), int(np.argmax(draft_probs[1]))]
    draw_rng = np.random.default_rng(1)
    for _ in range(draws):
        if draft == "model":
            guesses = [int(draw_rng.choice(vocab, p=draft_probs[0])), int(draw_rng.choice(vocab, p=draft_probs[1]))]
            tokens, accepted = rejection_sample(target.__getitem__, guesses, draft_probs, draw_rng)
        else:
            guesses = fixed_guesses
            tokens, accepted = rejection_sample(target.__getitem__, guesses, None, draw_rng)
        assert len(tokens) == accepted + 1 and tokens[:accepted] == guesses[:accepted]
        first.append(tokens[0])
        num_tokens.append(len(tokens))
        if accepted >= 1:
            second_after_accept.append(tokens[1])
    assert chi_square_pvalue(np.asarray(first), target[0]) > 1e-3
    assert chi_square_pvalue(np.asarray(second_after_accept), target[1]) > 1e-3
    assert max(num_tokens) == 3 and min(num_tokens) == 1


def test_rejection_sampling_accepts_every_guess_when_draft_equals_target():
    rng = np.random.default_rng(2)
    p = np.stack([random_probs(rng, 6) for _ in range(4)])
    for _ in range(200):
        guesses = [int(rng.choice(6, p=p[i])) for i in range(3)]
        tokens, accepted = rejection_sample(p.__getitem__, guesses, p[:3], rng)
        assert accepted == 3 and tokens[:3] == guesses


def test_ngram_sampling_keeps_the_fake_models_distribution_at_engine_level():
    """Engine level, seeded requests: after the first token (sampled from the prefill, no guess), the next two come
    from one verify step of one guess (n-gram); each must follow the fake model's tempered distribution given
    the tokens before it (chi-square on the likeliest history)."""
    config = FakeConfig(vocab_size=8)
    prompt = [2, 3, 4, 2, 3, 4, 2, 3, 4, 5, 6, 7, 2, 3]
    params = [SamplingParams(temperature=1.5, max_tokens=3, seed=s, ignore_eos=True) for s in range(4000)]
    engine = spec_engine(config, SpeculativeConfig("ngram", 2))
    outputs = [r.outputs[0].token_ids for r in engine.generate([prompt] * len(params), params)]
    # max_tokens leaves room for one guess, made when the first token occurs in the prompt
    assert engine.stats().spec_num_draft_tokens > len(params) // 4
    assert 0 < engine.stats().spec_num_accepted_tokens < engine.stats().spec_num_draft_tokens

    def target(context):
        logits = context_logits(np.asarray(context), 8).astype(np.float64) / 1.5
        p = np.exp(logits - logits.max())
        return p / p.sum()

    for position in (1, 2):
        histories = [tuple(o[:position]) for o in outputs]
        likeliest = max(set(histories), key=histories.count)
        samples = np.asarray([o[position] for o in outputs if tuple(o[:position]) == likeliest])
        assert len(samples) > 300
        assert chi_square_pvalue(samples, target(prompt + list(likeliest))) > 1e-3, position


# -- compiled module ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_artifact(checkpoint_dir, tmp_path_factory):
    return compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=tmp_path_factory.mktemp("art") / "m")


@pytest.mark.parametrize("k", [2, 5])
def test_compiled_ngram_greedy_equals_no_speculation_batched_with_prefix_caching(llama_artifact, k):
    rng = np.random.default_rng(k)
    base = [int(t) for t in rng.integers(2, 380, 20)]
    requests = [
        (
            base[: rng.integers(0, 21)] + [int(t) for t in rng.integers(2, 380, rng.integers(1, 12))],
            SamplingParams(temperature=0, max_tokens=int(rng.integers(8, 40)), ignore_eos=True),
        )
        for _ in range(8)
    ]
    arrivals = [int(a) for a in rng.integers(0, 10, len(requests))]
    got, stats = {}, {}
    # 14 blocks of 16 tokens for up to 6 sequences of up to 70 tokens: preemption is likely
    with CompiledModel.load(
        llama_artifact, kv_cache_memory=14 * 4096, max_num_seqs=6, max_num_logits=6 * (k + 1)
    ) as model:
        for speculative in (None, SpeculativeConfig("ngram", k)):
            engine = LLMEngine(model, max_num_batched_tokens=24, speculative=speculative)
            got[speculative is not None] = run_with_arrivals(engine, requests, arrivals)
            stats[speculative is not None] = engine.stats()
            assert engine.kv_cache.num_free_blocks == model.num_blocks
    for i in range(len(requests)):
        assert got[True][i] == got[False][i], f"request {i} changed with n-gram speculation"
    assert stats[True].spec_num_draft_tokens > 0 and stats[True].spec_num_accepted_tokens > 0
    assert stats[True].prefix_cache_hits > 0


def _cli(*args):
    from click.testing import CliRunner

    from llmc.tools import cli

    result = CliRunner().invoke(cli.main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def test_cli_run_json_reports_guesses_and_bench_prints_the_acceptance_rate(llama_artifact):
    import json

    prompt = (
        "run",
        llama_artifact,
        "--prompt",
        "a b c d a b c d a b",
        "--max-tokens",
        24,
        "--temperature",
        0,
        "--json",
        "--kv-cache-memory",
        "1MiB",
    )
    plain = json.loads(_cli(*prompt).stdout)
    spec = json.loads(_cli(*prompt, "--speculative", "ngram", "--num-speculative-tokens", 3).stdout)
    assert "speculative" not in plain and spec["token_ids"] == plain["token_ids"]
    assert spec["speculative"]["proposed"] >= spec["speculative"]["accepted"] >= 0 and spec["speculative"]["proposed"]
    # the target as its own draft: every guess accepted
    spec = json.loads(_cli(*prompt, "--speculative", "draft", "--draft", llama_artifact).stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["speculative"]["proposed"] == spec["speculative"]["accepted"] > 0
    from click.testing import CliRunner

    from llmc.tools import cli

    for flags in (("--draft", llama_artifact), ("--speculative", "draft")):
        r = CliRunner().invoke(cli.main, [str(a) for a in (*prompt, *flags)])
        assert r.exit_code == 1 and "--speculative draft" in r.output

    bench = (
        "bench",
        llama_artifact,
        "--concurrency",
        "1,2",
        "--prompt-len",
        8,
        "--output-len",
        12,
        "--memory-bandwidth",
        1e10,
        "--kv-cache-memory",
        "1MiB",
        "--speculative",
        "ngram",
    )
    out = json.loads(_cli(*bench, "--json").stdout)
    assert out["speculative"]["method"] == "ngram" and out["speculative"]["num_speculative_tokens"] == 4
    assert all(level["spec_draft_tokens"] >= level["spec_accepted_tokens"] >= 0 for level in out["levels"])
    assert sum(level["spec_draft_tokens"] for level in out["levels"]) > 0
    table = _cli(*bench).stdout
    assert "spec accept" in table and "guesses accepted" in table


def test_metrics_count_guesses_verified_and_accepted():
    from fastapi.testclient import TestClient

    from llmc.runtime.async_engine import AsyncLLMEngine
    from llmc.runtime.server import create_app
    from tests.runtime.test_metrics import scrape

    tok = byte_level_bpe()
    config = FakeConfig(vocab_size=tok.get_vocab_size())
    engine = spec_engine(config, SpeculativeConfig("ngram", 3), OracleProposer(config, 0.3, 0))
    engine.tokenizer = tok
    with TestClient(create_app(AsyncLLMEngine(engine), tok, "spec", None)) as http:
        assert scrape(http)[("llmc:spec_decode_num_draft_tokens_total", ())] == 0
        r = http.post(
            "/v1/completions",
            json={"prompt": [2, 3, 4, 2, 3, 4, 2, 3], "max_tokens": 30, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        samples = scrape(http)
    stats = engine.stats()
    assert samples[("llmc:spec_decode_num_draft_tokens_total", ())] == stats.spec_num_draft_tokens > 0
    assert samples[("llmc:spec_decode_num_accepted_tokens_total", ())] == stats.spec_num_accepted_tokens


# -- the draft-model proposer ------------------------------------------------------------------------------


class NoisyDraft(FakeModel):
    """A draft that agrees with the fake target often but not always: the target's logits plus noise that is
    itself a function of the context (so the draft is a deterministic model of its own)."""

    def step(self, batch):
        logits = super().step(batch)
        for row in logits:
            noise = np.random.default_rng(abs(hash(row.tobytes())) % 2**32).standard_normal(row.shape[0])
            row += (2.0 * noise).astype(np.float32)
        return logits


def draft_engine(config, k, draft_blocks=24, **kw):
    draft = NoisyDraft(config, num_blocks=draft_blocks, block_size=4, max_num_tokens=16, max_num_seqs=6)
    return spec_engine(config, SpeculativeConfig("draft", k, draft_model=draft), **kw), draft


@pytest.mark.parametrize("seed", range(4))
def test_draft_greedy_equals_the_reference_under_preemption_and_prefix_caching(seed):
    config = FakeConfig()
    requests, arrivals = workload(seed, 16, config.vocab_size, ignore_eos=False)
    # a draft cache of 10 blocks cannot hold every sequence: some get no guesses some steps
    engine, draft = draft_engine(config, 3, draft_blocks=10)
    got = run_with_arrivals(engine, requests, arrivals)
    for i, (prompt, params) in enumerate(requests):
        assert got[i][0] == reference_greedy(prompt, params.max_tokens, config, engine.max_model_len), f"request {i}"
    st = engine.stats()
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.num_free_blocks == 24 and engine._proposer.kv_cache.num_free_blocks == 10
    assert not engine._proposer._computed


def test_draft_equal_to_the_target_has_every_guess_accepted():
    config = FakeConfig(eos_token_ids=(999,))
    draft = FakeModel(config, num_blocks=24, block_size=4, max_num_tokens=16, max_num_seqs=6)
    engine = spec_engine(config, SpeculativeConfig("draft", 4, draft_model=draft))
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=21, ignore_eos=True))
    assert out[0].outputs[0].token_ids == reference_greedy([5, 6, 7], 21, config)
    st = engine.stats()
    assert st.spec_num_draft_tokens == st.spec_num_accepted_tokens == 16  # 1 from the prompt, then 4 x (4 + 1)


def test_draft_sampling_keeps_the_target_distribution_at_engine_level():
    """As the n-gram check, with guesses drawn from the noisy draft's own distribution q."""
    config = FakeConfig(vocab_size=8)
    prompt = [2, 3, 4, 5]
    params = [SamplingParams(temperature=1.3, max_tokens=3, seed=s, ignore_eos=True) for s in range(4000)]
    engine, _ = draft_engine(config, 2)
    outputs = [r.outputs[0].token_ids for r in engine.generate([prompt] * len(params), params)]
    st = engine.stats()
    # one guess after the first token (max_tokens leaves room for no more), or two after a prompt whose last token
    # a chunked prefill left for the next step
    assert st.spec_num_draft_tokens >= len(params)
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens

    def target(context):
        logits = context_logits(np.asarray(context), 8).astype(np.float64) / 1.3
        p = np.exp(logits - logits.max())
        return p / p.sum()

    for position in (1, 2):
        histories = [tuple(o[:position]) for o in outputs]
        likeliest = max(set(histories), key=histories.count)
        samples = np.asarray([o[position] for o in outputs if tuple(o[:position]) == likeliest])
        assert len(samples) > 300
        assert chi_square_pvalue(samples, target(prompt + list(likeliest))) > 1e-3, position


def test_draft_with_another_vocabulary_is_refused():
    draft = FakeModel(FakeConfig(vocab_size=32))
    with pytest.raises(LlmcError, match="vocabulary"):
        spec_engine(FakeConfig(), SpeculativeConfig("draft", 2, draft_model=draft))


@pytest.mark.parametrize("draft_kind", ["itself", "one layer"])
def test_compiled_draft_greedy_equals_no_speculation(llama_artifact, checkpoint_dir, tmp_path, draft_kind):
    """The target as its own draft must have every guess accepted (the draft's cache, positions and rollback
    are right); a random one-layer draft agrees with it by chance only, and the output must not change either."""
    draft_path = (
        llama_artifact
        if draft_kind == "itself"
        else compile_checkpoint(checkpoint_dir("llama", num_hidden_layers=1), target="cpu", output=tmp_path / "d")
    )
    rng = np.random.default_rng(3)
    requests = [
        (
            [int(t) for t in rng.integers(2, 380, rng.integers(1, 30))],
            SamplingParams(temperature=0, max_tokens=int(rng.integers(8, 30)), ignore_eos=True),
        )
        for _ in range(6)
    ]
    arrivals = [int(a) for a in rng.integers(0, 6, len(requests))]
    got, stats = {}, {}
    with (
        CompiledModel.load(llama_artifact, kv_cache_memory=14 * 4096, max_num_seqs=4, max_num_logits=16) as model,
        CompiledModel.load(draft_path, kv_cache_memory=8 * 4096, max_num_seqs=4) as draft,
    ):
        for speculative in (None, SpeculativeConfig("draft", 3, draft_model=draft)):
            engine = LLMEngine(model, max_num_batched_tokens=24, speculative=speculative)
            got[speculative is not None] = run_with_arrivals(engine, requests, arrivals)
            stats[speculative is not None] = engine.stats()
    for i in range(len(requests)):
        assert got[True][i] == got[False][i], f"request {i} changed with a draft model"
    assert stats[True].spec_num_draft_tokens > 0
    if draft_kind == "itself":
        assert stats[True].spec_num_accepted_tokens == stats[True].spec_num_draft_tokens


def test_trim_slots_gives_back_whole_blocks_past_the_kept_tokens():
    from llmc.runtime.kv_cache import KVCacheManager

    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    assert kv.allocate_slots("a", 6)
    kv.cache_blocks("a", list(range(6)), 6)  # one full block cached
    assert kv.allocate_slots("a", 5)  # 11 slots: 3 blocks
    table = kv.block_ids("a")
    kv.trim_slots("a", 8)  # 2 blocks hold 8 slots: the third goes back
    assert kv.block_ids("a") == table[:2] and kv.num_slots("a") == 8 and kv.num_free_blocks == 6
    kv.trim_slots("a", 5)
    assert kv.block_ids("a") == table[:2] and kv.num_slots("a") == 5
    assert kv.allocate_slots("a", 4)  # the slots count from 5 again: 9 slots, 3 blocks
    assert kv.num_slots("a") == 9 and len(kv.block_ids("a")) == 3
    with pytest.raises(AssertionError):
        kv.trim_slots("a", 3)  # below the cached block


def test_stop_strings_cut_an_accepted_run_as_without_speculation():
    tok = byte_level_bpe()
    config = FakeConfig(vocab_size=tok.get_vocab_size(), eos_token_ids=(999,))
    prompt = [5, 6, 7]
    plain = spec_engine(config, None)
    plain.tokenizer = tok
    full = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    for cut in (3, 9, 17):
        stop = full.text[cut : cut + 2]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        got = []
        for speculative in (None, SpeculativeConfig("ngram", 4)):
            engine = spec_engine(config, speculative, None if speculative is None else OracleProposer(config, 0.0, 0))
            engine.tokenizer = tok
            out = engine.generate([prompt], params)[0].outputs[0]
            got.append((out.token_ids, out.text, out.finish_reason, out.stop_reason))
        assert got[0] == got[1] and got[0][2] == "stop" and stop not in got[0][1]


def test_the_shipped_draft_shares_the_bundled_models_tokenizer_and_is_not_taken_for_it():
    import json

    from llmc.examples import EXAMPLES_DIR, bundled_checkpoint

    draft, bundled = EXAMPLES_DIR / "pystdlib-5m-draft", EXAMPLES_DIR / "pystdlib-5m"
    assert (draft / "tokenizer.json").read_bytes() == (bundled / "tokenizer.json").read_bytes()
    configs = [json.loads((d / "config.json").read_text()) for d in (draft, bundled)]
    assert configs[0]["vocab_size"] == configs[1]["vocab_size"]
    assert configs[0]["eos_token_id"] == configs[1]["eos_token_id"]
    assert bundled_checkpoint().name == "pystdlib-5m"


def test_compiled_sliding_window_with_ngram_guesses_equals_no_speculation(checkpoint_dir, tmp_path):
    """Mistral layers that see the last 6 positions: blocks behind the window go back to the pool while guesses
    are written and rolled back; a cache of 4 blocks still serves 96-token sequences, with the same tokens."""
    path = checkpoint_dir("mistral", sliding_window=6)
    artifact = compile_checkpoint(path, target="cpu", output=tmp_path / "m")
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(2, 380, n)] for n in (20, 9)]
    params = SamplingParams(temperature=0, max_tokens=76, ignore_eos=True)
    per_block = 2 * 2 * 16 * 3 * 8 * 4  # k and v, 2 layers, 16 slots of 3 kv heads x 8 dims, fp32
    got, stats = {}, {}
    with CompiledModel.load(artifact, kv_cache_memory=4 * per_block, max_num_seqs=2, max_num_logits=10) as model:
        for speculative in (None, SpeculativeConfig("ngram", 4)):
            engine = LLMEngine(model, max_num_batched_tokens=8, speculative=speculative)
            got[speculative is not None] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
            stats[speculative is not None] = engine.stats()
            assert engine.kv_cache.num_free_blocks == 4
    assert got[True] == got[False]
    assert stats[True].spec_num_draft_tokens > 0


def test_cli_serve_with_a_draft_model_counts_guesses_in_metrics(llama_artifact, monkeypatch):
    from fastapi.testclient import TestClient

    from llmc.runtime import server
    from tests.runtime.test_metrics import scrape

    seen = {}

    def fake_serve(app, host, port, **kw):
        with TestClient(app, base_url=f"http://{host}:{port}") as http:  # the Host names it answers
            seen["completion"] = http.post(
                "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            ).json()
            seen["metrics"] = scrape(http)

    monkeypatch.setattr(server, "serve", fake_serve)
    _cli(
        "serve",
        llama_artifact,
        "--kv-cache-memory",
        "1MiB",
        "--max-num-seqs",
        4,
        "--speculative",
        "draft",
        "--draft",
        llama_artifact,
        "--num-speculative-tokens",
        3,
    )
    assert seen["completion"]["usage"]["completion_tokens"] == 12
    drafted = seen["metrics"][("llmc:spec_decode_num_draft_tokens_total", ())]
    assert drafted > 0 and seen["metrics"][("llmc:spec_decode_num_accepted_tokens_total", ())] == drafted
