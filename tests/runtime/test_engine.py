import asyncio
import dataclasses

import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.engine import LLMEngine
from llmc.sampling_params import SamplingParams
from tests.runtime.runtime_fakes import (
    FakeConfig,
    FakeModel,
    byte_level_bpe,
    context_logits,
    reference_greedy,
    run_with_arrivals,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def engine_for(model_kwargs=None, config=None, tokenizer=None, **engine_kwargs):
    return LLMEngine(FakeModel(config, **(model_kwargs or {})), tokenizer, seed=0, **engine_kwargs)


def random_requests(rng, count, vocab, max_prompt, max_new):
    return [
        ([int(t) for t in rng.integers(2, vocab, rng.integers(1, max_prompt + 1))], int(rng.integers(1, max_new + 1)))
        for _ in range(count)
    ]


def test_greedy_matches_the_cacheless_reference():
    config = FakeConfig()
    engine = engine_for(config=config)
    rng = np.random.default_rng(0)
    reqs = random_requests(rng, 6, config.vocab_size, 40, 20)
    results = engine.generate([p for p, _ in reqs], [dataclasses.replace(GREEDY, max_tokens=m) for _, m in reqs])
    for (prompt, max_new), result in zip(reqs, results, strict=True):
        assert result.outputs[0].token_ids == reference_greedy(prompt, max_new, config)


# Batching changes nothing: each request alone, token for token. The cases force chunked prefill (small
# token budget), a tiny cache with preemption, block_size 1, and a cap on concurrent sequences.
CASES = {
    "roomy": dict(num_blocks=256, block_size=16, max_num_tokens=256, max_num_seqs=16),
    "chunked_prefill": dict(num_blocks=256, block_size=16, max_num_tokens=7, max_num_seqs=16),
    "tiny_cache_preempts": dict(num_blocks=14, block_size=4, max_num_tokens=24, max_num_seqs=8),
    "block_size_1": dict(num_blocks=60, block_size=1, max_num_tokens=16, max_num_seqs=4),
    "two_seqs": dict(num_blocks=64, block_size=8, max_num_tokens=64, max_num_seqs=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batching_changes_nothing_greedy(case):
    model_kwargs = CASES[case]
    config = FakeConfig()
    rng = np.random.default_rng(hash(case) % 2**32)
    raw = random_requests(rng, 14, config.vocab_size, 30, 25)
    requests = [(p, dataclasses.replace(GREEDY, max_tokens=m)) for p, m in raw]
    arrivals = rng.integers(0, 30, len(requests))

    batched = engine_for(model_kwargs, config)
    got = run_with_arrivals(batched, requests, arrivals)
    for i, (prompt, params) in enumerate(requests):
        alone = engine_for(model_kwargs, config).generate([prompt], params)[0].outputs[0]
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"
        assert alone.token_ids == reference_greedy(prompt, params.max_tokens, config, batched.max_model_len)
    assert batched.kv_cache.num_free_blocks == model_kwargs["num_blocks"]
    if case == "tiny_cache_preempts":
        assert batched.scheduler.num_preemptions > 0
    else:
        assert batched.model.max_batch_seen > 1


def test_seeded_sampling_reproduces_alone_and_in_a_busy_batch():
    config = FakeConfig()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=123, max_tokens=24)
    prompt = [5, 6, 7, 8, 9, 10]
    tiny = dict(num_blocks=16, block_size=4, max_num_tokens=16, max_num_seqs=8)
    alone = engine_for(tiny, config).generate([prompt], seeded)[0].outputs[0].token_ids

    rng = np.random.default_rng(7)
    noise = [(p, SamplingParams(temperature=1.3, max_tokens=m)) for p, m in random_requests(rng, 9, 64, 20, 20)]
    requests = noise[:4] + [(prompt, seeded)] + noise[4:]
    batched = engine_for(tiny, config)
    got = run_with_arrivals(batched, requests, rng.integers(0, 6, len(requests)))
    assert got[4][0] == alone
    assert batched.scheduler.num_preemptions > 0
    other_seed = engine_for(tiny, config).generate([prompt], dataclasses.replace(seeded, seed=124))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_n_sequences_are_independent_seeded_children():
    engine = engine_for()
    params = SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=12)
    result = engine.generate([[3, 4, 5]], params)[0]
    assert [c.index for c in result.outputs] == [0, 1, 2]
    for i, completion in enumerate(result.outputs):  # child i is the request with seed + i
        single = engine_for().generate([[3, 4, 5]], dataclasses.replace(params, n=1, seed=40 + i))[0].outputs[0]
        assert completion.token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in result.outputs}) == 3
    greedy = engine.generate([[3, 4, 5]], dataclasses.replace(GREEDY, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def _free_run(prompt, n=20):
    return reference_greedy(prompt, n, dataclasses.replace(FakeConfig(), eos_token_ids=()))


def test_stop_rules_eos_stop_token_min_tokens_ignore_eos_length():
    prompt = [10, 11, 12]
    free = _free_run(prompt)
    target = free[3]
    first = free.index(target)
    config = FakeConfig(eos_token_ids=(target,))

    out = engine_for(config=config).generate([prompt], GREEDY)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (free[: first + 1], "stop", None)

    out = (
        engine_for(config=dataclasses.replace(config, eos_token_ids=()))
        .generate([prompt], dataclasses.replace(GREEDY, stop_token_ids=[target]))[0]
        .outputs[0]
    )
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (free[: first + 1], "stop", target)

    out = engine_for(config=config).generate([prompt], dataclasses.replace(GREEDY, ignore_eos=True))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free, "length")

    out = engine_for(config=config).generate([prompt], dataclasses.replace(GREEDY, min_tokens=first + 3))[0].outputs[0]
    assert target not in out.token_ids[: first + 3]  # suppressed while min_tokens are not out

    out = engine_for(config=config).generate([prompt], dataclasses.replace(GREEDY, max_tokens=first))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free[:first], "length")


def test_context_and_cache_cap_the_sequence_with_length():
    config = FakeConfig(max_position_embeddings=12, eos_token_ids=())
    engine = engine_for(config=config)
    out = engine.generate([list(range(2, 12))], dataclasses.replace(GREEDY, max_tokens=None))[0].outputs[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"  # 10 + 2 = the context

    engine = engine_for(dict(num_blocks=4, block_size=4), FakeConfig(eos_token_ids=()))
    assert engine.max_model_len == 16
    out = engine.generate([list(range(2, 12))], dataclasses.replace(GREEDY, max_tokens=None))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert engine.kv_cache.num_free_blocks == 4


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        (list(range(2, 60)) * 10, GREEDY, "model's context of 512"),
        (list(range(2, 50)), GREEDY, "KV cache can hold at most 32"),
        ([], GREEDY, "empty"),
        ([3, 64], GREEDY, "outside the vocabulary"),
        ([3, 4], SamplingParams(stop=["x"]), "need a tokenizer"),
    ],
)
def test_unservable_requests_raise_request_error(prompt, params, match):
    engine = engine_for(dict(num_blocks=2, block_size=16))
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_abort_frees_blocks_at_once():
    engine = engine_for(dict(num_blocks=32, block_size=4))
    ids = [engine.add_request(list(range(2, 2 + n)), dataclasses.replace(GREEDY, max_tokens=50)) for n in (9, 17, 5)]
    engine.step()
    engine.step()
    victim_blocks = len(engine.kv_cache.block_ids(ids[1]))
    free_before = engine.kv_cache.num_free_blocks
    assert engine.abort(ids[1])
    assert engine.kv_cache.num_free_blocks == free_before + victim_blocks
    assert not engine.abort(ids[1]) and not engine.abort("unknown")
    while engine.has_unfinished():
        assert all(out.req_id != ids[1] for out in engine.step())
    assert engine.kv_cache.num_free_blocks == 32


def test_logprobs_are_raw_model_logprobs():
    engine = engine_for()
    prompt = [7, 8, 9]
    params = SamplingParams(temperature=0.8, seed=3, logprobs=2, max_tokens=5)
    out = engine.generate([prompt], params)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    context = list(prompt)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        raw = context_logits(np.asarray(context), 64).astype(np.float64)
        ref = raw - np.log(np.exp(raw - raw.max()).sum()) - raw.max()
        assert token in lp and 2 <= len(lp) <= 3
        for t, v in lp.items():
            assert v == pytest.approx(ref[t], abs=1e-5)
        context.append(token)


def test_text_streaming_and_stop_strings_with_a_tokenizer():
    tok = byte_level_bpe()
    config = FakeConfig(vocab_size=tok.get_vocab_size(), eos_token_ids=(tok.token_to_id("</s>"),))
    prompt = tok.encode("the quick brown").ids
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)

    engine = engine_for(config=config, tokenizer=tok)
    req = engine.add_request(prompt, params)
    deltas, ids = [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.req_id == req
            deltas.append(out.new_text)
            ids.extend(out.new_token_ids)
    full = "".join(deltas)
    assert full == tok.decode(ids) and len(full) > 10

    stop = full[len(full) // 3 : len(full) // 3 + 4]  # some 4 characters inside the output
    cut = full.index(stop)
    stopped = engine_for(config=config, tokenizer=tok).generate([prompt], dataclasses.replace(params, stop=[stop]))
    out = stopped[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:cut], "stop", stop)
    assert out.token_ids == ids[: len(out.token_ids)]

    text_out = engine_for(config=config, tokenizer=tok).generate(["the quick brown"], params)[0].outputs[0]
    assert text_out.text == full  # a text prompt is encoded with the tokenizer


# -- async ------------------------------------------------------------------------------------------------


def test_async_engine_streams_concurrent_requests_like_the_sync_engine():
    rng = np.random.default_rng(5)
    reqs = [(p, dataclasses.replace(GREEDY, max_tokens=m)) for p, m in random_requests(rng, 6, 64, 20, 15)]
    expected = [engine_for().generate([p], sp)[0].outputs[0].token_ids for p, sp in reqs]

    async def main():
        aengine = AsyncLLMEngine(engine_for(dict(num_blocks=20, block_size=4, max_num_tokens=16)))

        async def one(prompt, params):
            tokens = []
            async for out in aengine.generate(prompt, params):
                tokens.extend(out.new_token_ids)
            return tokens

        got = await asyncio.gather(*(one(p, sp) for p, sp in reqs))
        await aengine.shutdown()
        return got

    assert asyncio.run(main()) == expected


def test_async_engine_aborts_when_the_client_leaves_and_rejects_bad_requests():
    async def main():
        engine = engine_for(dict(num_blocks=128, block_size=4))
        aengine = AsyncLLMEngine(engine)
        long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)

        stream = aengine.generate([2, 3, 4], long)
        async for out in stream:
            if out.num_output_tokens == 3:
                break  # the client disconnected
        await stream.aclose()
        for _ in range(200):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == 128

        with pytest.raises(RequestError, match="empty"):
            async for _ in aengine.generate([], long):
                pass

        started = asyncio.Event()

        async def consume(req_id):
            outs = []
            async for out in aengine.generate([5, 6], long, req_id=req_id):
                outs.append(out)
                started.set()
            return outs

        task = asyncio.ensure_future(consume("x"))
        await started.wait()
        aengine.abort("x")  # e.g. the server cancels it from another task
        outs = await asyncio.wait_for(task, 5)
        assert outs and not any(o.finished for o in outs)  # ended by the abort, not by a stop rule
        for _ in range(200):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await aengine.shutdown()
        assert engine.kv_cache.num_free_blocks == 128

    asyncio.run(main())


class FailingModel(FakeModel):
    """Raises on any step that holds `poison`, as a model bug would."""

    poison = 63

    def step(self, batch):
        if self.poison in batch.token_ids:
            raise RuntimeError("model failure")
        return super().step(batch)


def test_a_failing_step_aborts_its_requests_and_the_engine_goes_on():
    engine = LLMEngine(FailingModel(max_num_seqs=1), seed=0)  # one sequence per step: the second request waits
    bad = engine.add_request([5, FailingModel.poison, 7], SamplingParams(n=2, temperature=0.0, max_tokens=4))
    good = engine.add_request([5, 6, 7], GREEDY)
    outputs = engine.step()
    assert [(o.req_id, o.finish_reason, str(o.error)) for o in outputs] == [(bad, "error", "model failure")]
    tokens = []
    while engine.has_unfinished():
        outputs = engine.step()
        assert all(o.req_id == good for o in outputs)
        tokens += [t for o in outputs for t in o.new_token_ids]
    assert tokens == reference_greedy([5, 6, 7], 20, FakeConfig())
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    with pytest.raises(RuntimeError, match="model failure"):  # the sync convenience API raises it
        engine.generate([[FailingModel.poison]], GREEDY)
    assert not engine.has_unfinished()


def test_a_sampling_failure_aborts_only_its_request(monkeypatch):
    import llmc.runtime.engine as engine_module

    engine = engine_for()
    bad = engine.add_request([3, 4], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[9]))
    good = engine.add_request([3, 4], SamplingParams(temperature=0.0, max_tokens=5))
    real = engine_module.sample_next_token

    def sample(logits, params, *args):
        if params.stop_token_ids:
            raise ValueError("sampler bug")
        return real(logits, params, *args)

    monkeypatch.setattr(engine_module, "sample_next_token", sample)
    outputs = engine.step()
    assert {o.req_id: o.finish_reason for o in outputs} == {bad: "error", good: None}
    while engine.has_unfinished():
        outputs += engine.step()
    assert sum(len(o.new_token_ids) for o in outputs if o.req_id == good) == 5
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_async_engine_fails_the_request_not_the_loop():
    async def main():
        engine = AsyncLLMEngine(LLMEngine(FailingModel(), seed=0))
        with pytest.raises(RuntimeError, match="model failure"):
            async for _ in engine.generate([FailingModel.poison], GREEDY):
                pass
        got = [t async for out in engine.generate([5, 6, 7], GREEDY) for t in out.new_token_ids]
        assert engine.healthy and engine.num_requests == 0
        await engine.shutdown()
        return got

    assert asyncio.run(main()) == reference_greedy([5, 6, 7], 20, FakeConfig())
