"""What a monitoring system reads at ``GET /metrics``: Prometheus text through ``prometheus_client``.

Gauges ``metrale_requests_running``, ``metrale_requests_waiting``, ``metrale_slots_used``,
``metrale_kv_blocks_used``; counters ``metrale_prompt_tokens_total``, ``metrale_generation_tokens_total``,
``metrale_requests_cancelled_total``, ``metrale_preemptions_total``, ``metrale_prefix_cache_queries_total``,
``metrale_prefix_cache_hits_total``, ``metrale_recoveries_total`` (recoveries from lost worker ranks); histograms
``metrale_time_to_first_token_seconds`` (from a request's arrival) and
``metrale_inter_token_latency_seconds``; the enum ``metrale_run_state``
(``serving``, ``draining``, ``stopped``).  Each app has its own registry.
"""

from __future__ import annotations

from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest

RunState = Literal["serving", "draining", "stopped"]
_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The server's metrics, set by the scheduler's thread (``prometheus_client`` is thread-safe)."""

    def __init__(self) -> None:
        self.registry: CollectorRegistry = CollectorRegistry()
        registry = self.registry
        self.running: Gauge = Gauge("metrale_requests_running", "Requests holding a slot.", registry=registry)
        self.waiting: Gauge = Gauge("metrale_requests_waiting", "Requests waiting for a slot.", registry=registry)
        self.slots_used: Gauge = Gauge(
            "metrale_slots_used", "Slots holding a sequence, on every rank.", registry=registry
        )
        self.kv_blocks_used: Gauge = Gauge(
            "metrale_kv_blocks_used", "Blocks of the KV cache that a sequence holds, on every rank.", registry=registry
        )

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, registry=registry)

        self.prompt_tokens: Counter = counter("metrale_prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens: Counter = counter("metrale_generation_tokens", "Tokens generated.")
        self.cancelled: Counter = counter(
            "metrale_requests_cancelled", "Requests cancelled (a client gone, or a stop string)."
        )
        self.recoveries: Counter = counter(
            "metrale_recoveries",
            "Recoveries from lost worker ranks: the ranks left re-formed and carried every request on.",
        )
        self.preemptions: Counter = counter(
            "metrale_preemptions",
            "Requests preempted for the KV blocks others needed (each resumes, its tokens computed again).",
        )
        self.prefix_queries: Counter = counter(
            "metrale_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits: Counter = counter(
            "metrale_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again)."
        )
        self.time_to_first_token: Histogram = Histogram(
            "metrale_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency: Histogram = Histogram(
            "metrale_inter_token_latency_seconds",
            "Between two tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.state: Enum = Enum(
            "metrale_run_state", "The run's state.", states=["serving", "draining", "stopped"], registry=registry
        )

    def set_state(self, state: RunState) -> None:
        self.state.state(state)

    def text(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)
