"""Prometheus metrics of ``kvlab serve``, named as vLLM names them, under the ``kvlab:`` prefix.

The mapping: each kvlab name is the vLLM V1 name with ``kvlab:`` for ``vllm:`` (prometheus_client
adds ``_total`` to counters on export, as it does for vLLM):

| vLLM / kvlab name (no prefix)       | what                                   |
|-------------------------------------|----------------------------------------|
| ``num_requests_running``            | gauge, requests in the running batch   |
| ``num_requests_waiting``            | gauge, queued (server inbox + engine)  |
| ``kv_cache_usage_perc``             | gauge, 0..1 of blocks held by requests |
| ``prefix_cache_queries``            | counter, prompt tokens looked up       |
| ``prefix_cache_hits``               | counter, prompt tokens found cached    |
| ``num_preemptions``                 | counter, preempted sequences           |
| ``prompt_tokens``                   | counter, prompt tokens of requests     |
| ``generation_tokens``               | counter, generated tokens              |
| ``request_success``                 | counter by ``finished_reason``         |
| ``time_to_first_token_seconds``     | histogram, arrival -> first token      |
| ``inter_token_latency_seconds``     | histogram, between token deliveries    |
| ``e2e_request_latency_seconds``     | histogram, arrival -> finished         |
| ``request_prompt_tokens``           | histogram, prompt length               |
| ``request_generation_tokens``       | histogram, output length               |

Every series carries ``model_name`` as vLLM's do. The token counters are counted per request when it
ends (the numbers its ``usage`` reports: ``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``), so over a set of finished requests they equal the sums of
their responses; a request that was refused before reaching the engine counts nowhere, one that was
aborted (client gone) counts what it had generated. vLLM counts queries and hits per scheduling
instead, so after a preemption its counters grow again; kvlab counts a request's first admission
only. ``kvlab.doctor`` reads ``kvlab:`` names the same way as ``vllm:`` ones (``parse_metrics``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.engine import Engine

__all__ = ["PREFIX", "ServeMetrics", "VLLM_NAMES"]

PREFIX = "kvlab:"
# kvlab name (without prefix) -> vLLM name; the mapping the module docstring shows
VLLM_NAMES = {name: f"vllm:{name}" for name in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_prompt_tokens", "request_generation_tokens")}

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
            2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class ServeMetrics:
    """The server's metrics in a registry of their own (several apps in one process do not
    collide)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        lab, reg = ["model_name"], self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, lab, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, lab, registry=reg).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, lab, buckets=buckets, registry=reg).labels(
                model_name
            )

        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge(
            "num_requests_waiting", "Requests waiting: in the server's inbox or the engine's queue."
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full)."
        )
        self.queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of finished requests."
        )
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=reg)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", _LATENCY)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between two token deliveries of a request.",
            _LATENCY,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finished.", _LATENCY)
        self.req_prompt = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKENS)
        self.req_gen = hist("request_generation_tokens", "Generated tokens per request.", _TOKENS)
        self._preempted = 0

    def on_step(self, engine: Engine, inbox: int = 0) -> None:
        """Refresh the gauges and the preemption counter from the engine (its thread, after a
        step)."""
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting) + inbox)
        self.kv_usage.set(engine.block_manager.usage)
        total = engine.num_preemptions
        if total > self._preempted:
            self.preemptions.inc(total - self._preempted)
            self._preempted = total

    def on_finish(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        finish_reason: str,
        e2e: float,
        admitted: bool = True,
    ) -> None:
        """Count one ended request: the token counters (if it reached the engine), its reason and
        latency."""
        if admitted:
            self.queries.inc(prompt_tokens)
            self.hits.inc(cached_tokens)
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(completion_tokens)
            self.req_prompt.observe(prompt_tokens)
            self.req_gen.observe(completion_tokens)
        self.success.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
