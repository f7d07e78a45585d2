"""Prometheus metrics of a serving front end (`GET /metrics`), named as vLLM names them, with `llmc:` for `vllm:`.

    metrics = ServerMetrics("my-model", lambda: engine.stats)
    track = metrics.track_request(num_prompt_tokens, arrival)   # per request
    track.output(out) ...; track.close()                         # per engine output, then once at the end
    body = metrics.render()                                       # the text format, for GET /metrics

Each app has its own CollectorRegistry, so several apps in one process (tests, a Ray Serve replica set) keep
their counts apart. Series (label `model_name` on each):
- counters: llmc:prompt_tokens_total, llmc:generation_tokens_total, llmc:num_preemptions_total,
  llmc:request_success_total{finished_reason="stop"|"length"|"abort"}, one per request (whatever its n), as
  the histograms count: "abort" when a sequence of it did not finish (a client that left, a request cut at
  shutdown, one whose step failed), else "length" when one hit its max_tokens or the context, else "stop".
- histograms (seconds), one observation per request: llmc:time_to_first_token_seconds (its first token, of
  any sequence), llmc:e2e_request_latency_seconds (requests whose sequences all finished); and
  llmc:inter_token_latency_seconds (vLLM's newer name for time per output token), per token of each sequence.
- gauges, read from the engine at each scrape: llmc:num_requests_running, llmc:num_requests_waiting (sequences,
  as the scheduler counts them), llmc:kv_cache_usage_perc (a fraction, 0..1, as vLLM's), and, with no vLLM
  counterpart, llmc:kv_cache_free_blocks and llmc:kv_cache_blocks (an idle engine must have all blocks free).
- counters read from the engine: llmc:prefix_cache_queries_total and llmc:prefix_cache_hits_total, in tokens
  (prompt tokens looked up, and of those found cached), as vLLM's: the hit rate is hits / queries; and
  llmc:spec_decode_num_draft_tokens_total and llmc:spec_decode_num_accepted_tokens_total (speculative guesses
  verified, and of those accepted; 0 with speculation off), as vLLM's: the acceptance rate is accepted / draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from llmc.runtime.outputs import EngineStats, RequestOutput

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # of what `render` returns (generate_latest's format)

# vLLM's buckets, with finer ones below 10 ms for inter-token latency: a small model on a CPU decodes that fast
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class _EngineCollector(Collector):
    """The engine's gauges, read at scrape time from its last stats snapshot (never stale, never locked)."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Iterator:
        s = self.stats()
        gauges = [
            ("llmc:num_requests_running", "Sequences running (holding KV blocks).", s.num_running),
            ("llmc:num_requests_waiting", "Sequences waiting for a step.", s.num_waiting),
            ("llmc:kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.", s.kv_cache_usage),
            ("llmc:kv_cache_free_blocks", "KV cache blocks free.", s.num_free_blocks),
            ("llmc:kv_cache_blocks", "KV cache blocks in all.", s.num_blocks),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        preemptions = CounterMetricFamily(
            "llmc:num_preemptions", "Sequences preempted (recomputed later).", labels=["model_name"]
        )
        preemptions.add_metric([self.model_name], s.num_preemptions)
        yield preemptions
        for name, doc, value in [
            ("llmc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("llmc:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("llmc:spec_decode_num_draft_tokens", "Speculative guesses verified.", s.spec_num_draft_tokens),
            ("llmc:spec_decode_num_accepted_tokens", "Speculative guesses accepted.", s.spec_num_accepted_tokens),
            ("llmc:structured_requests", "Requests with structured output (a grammar).", s.structured_requests),
            ("llmc:grammar_compiles", "Structured-output constraints compiled (cache misses).", s.grammar_compiles),
            ("llmc:grammar_compile_seconds", "Time compiling constraints.", s.grammar_compile_seconds),
            ("llmc:grammar_mask_steps", "Steps that computed grammar masks.", s.grammar_mask_steps),
            (
                "llmc:grammar_mask_seconds",
                "Time computing grammar masks, beside the model step.",
                s.grammar_mask_seconds,
            ),
        ]:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry(auto_describe=True)
        labels, reg = ["model_name"], self.registry
        self.prompt_tokens = Counter(
            "llmc:prompt_tokens", "Prompt tokens of requests that started.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter("llmc:generation_tokens", "Tokens generated.", labels, registry=reg).labels(
            model_name
        )
        self._success = Counter(
            "llmc:request_success", "Requests finished, by why.", [*labels, "finished_reason"], registry=reg
        )
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):  # every series from the start, so rate() sees its first increase
            self._success.labels(model_name, reason)
        self.ttft = Histogram(
            "llmc:time_to_first_token_seconds",
            "From arrival to the first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.inter_token = Histogram(
            "llmc:inter_token_latency_seconds",
            "Between two tokens of a sequence.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "llmc:e2e_request_latency_seconds",
            "From arrival to the last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        reg.register(_EngineCollector(model_name, stats))

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def track_request(self, num_prompt_tokens: int, n: int, arrival: float) -> RequestTracker:
        """A request's tracker; arrival: its time.perf_counter() when it came in."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTracker(self, n, arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_REASON_RANK = {"stop": 0, "length": 1, "abort": 2}  # a request's finished_reason: its sequences' highest


class RequestTracker:
    """Times one request (its n sequences) from the engine outputs it gets; close() it exactly once at the end."""

    def __init__(self, metrics: ServerMetrics, n: int, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last_token: list[float | None] = [None] * n  # per sequence
        self.unfinished = n
        self.reason: str | None = None  # of the sequences that ended: the highest in _REASON_RANK
        self.counted = False

    def output(self, out: RequestOutput) -> None:
        now, m = time.perf_counter(), self.metrics
        if out.new_token_ids:
            m.generation_tokens.inc(len(out.new_token_ids))
            last = self.last_token[out.index]
            if all(t is None for t in self.last_token):
                m.ttft.observe(now - self.arrival)
            elif last is not None:
                m.inter_token.observe(now - last)
            self.last_token[out.index] = now
        if out.finished:
            reason = out.finish_reason if out.finish_reason in _REASON_RANK else "abort"
            self.reason = max(self.reason or "stop", reason, key=_REASON_RANK.__getitem__)
            self.unfinished -= 1
            if not self.unfinished:
                m.e2e.observe(now - self.arrival)

    def close(self) -> None:
        """The request is over (counted once): with a sequence that did not finish, as aborted."""
        if not self.counted:
            self.metrics.finished("abort" if self.unfinished or self.reason is None else self.reason)
        self.counted = True
