"""Prometheus metrics, made with prometheus_client into a registry of the app's own (so two apps
in one process, as in tests, never share counters).

Three sources, each observed where it is already known, never recomputed:
- HTTP: every response's route, wire protocol and status (`observe.http.RequestMetrics`);
- the engine thread: each request's Timings (tokens, time to first token, prefill and decode
  speed, where its KV state came from and how long restoring it took), seen before the client
  gets its final event, so whoever has an answer finds it counted;
- the engine's busy time and the prompt cache's own counters (`PromptCache.counters`), read at
  scrape time by a custom collector, so bytes, evictions and disk use are the cache's numbers,
  not a second tally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_kvserve.engine import Engine, GenerationRequest
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.namespaces import caches_of

PREFIX = "mlx_kvserve"
TIERS = ("live", "ram", "disk")
# Seconds: from a RAM hit (~10 ms) to a cold 50k-token prefill on a small Mac (minutes).
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PREFILL_TPS_BUCKETS = (10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800)
DECODE_TPS_BUCKETS = (1, 2.5, 5, 10, 20, 40, 80, 160, 320)
# Where speculative decoding's drafts come from (engine/speculation/: drafts.py, the row's own
# tokens; continuations.py, finished requests' tokens in the prompt cache's namespace; mtp.py, the
# checkpoint's own MTP heads; draft_model.py, a small model of the same tokenizer).
DRAFT_SOURCES = ("prompt_lookup", "prompt_cache", "mtp", "draft_model")
RESTORE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Every metric of one server. `observe_request` runs on the engine thread as each request
    finishes; prometheus_client's metrics are thread-safe."""

    def __init__(self, engines: Callable[[], list[Engine]], *, cache_enabled: bool = True) -> None:
        """`engines()` gives the loaded models' engines (one per model; models.pool)."""
        self.registry = CollectorRegistry()
        self.cache_enabled = cache_enabled
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP responses by route, wire protocol and status code.",
            ["route", "protocol", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From the request reaching the engine queue to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prefill_tps = Histogram(
            f"{PREFIX}_prefill_tokens_per_second",
            "Prefill speed of each request over the prompt tokens it prefilled (not cached).",
            buckets=PREFILL_TPS_BUCKETS,
            registry=r,
        )
        self.decode_tps = Histogram(
            f"{PREFIX}_decode_tokens_per_second",
            "Decode speed of each request with more than one generated token.",
            buckets=DECODE_TPS_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_tokens",
            "Prompt tokens served from the prompt cache instead of prefilled.",
            registry=r,
        )
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens", "Completion tokens generated.", registry=r
        )
        self.embedding_inputs = Counter(
            f"{PREFIX}_embedding_inputs",
            "Embedding inputs: embedded, or dropped because their client left first.",
            ["outcome"],
            registry=r,
        )
        self.drafted = Counter(
            f"{PREFIX}_speculation_drafted_tokens",
            "Tokens speculative decoding drafted, by draft source (docs/speculation.md).",
            ["source"],
            registry=r,
        )
        self.accepted = Counter(
            f"{PREFIX}_speculation_accepted_tokens",
            "Drafted tokens that verification kept (each saved a decode pass), by source.",
            ["source"],
            registry=r,
        )
        self.verify_passes = Counter(
            f"{PREFIX}_speculation_passes",
            "Verify passes, counted once per request that drafted in the pass, by source: "
            "(accepted + passes) / passes is the tokens a row got per pass.",
            ["source"],
            registry=r,
        )
        for source in DRAFT_SOURCES:  # every series exists from the start, at 0
            for counter in (self.drafted, self.accepted, self.verify_passes):
                counter.labels(source)
        self.scored_prompts = Counter(
            f"{PREFIX}_scored_prompts",
            "Prompts whose own tokens' log probabilities a request asked for (echo with "
            "logprobs): scored, or dropped because their client left first.",
            ["outcome"],
            registry=r,
        )
        self.lookups = Counter(
            f"{PREFIX}_cache_lookups",
            "Prompt-cache lookups, one per request: outcome hit (tier live, ram or disk), miss "
            "(tier none) or failed (a restored state failed; the request was re-run from the "
            "newest link not blamed, engine/blame.py).",
            ["outcome", "tier"],
            registry=r,
        )
        self.restores = Counter(
            f"{PREFIX}_cache_restores",
            "Checkpoints restored into the model's KV caches, by tier.",
            ["tier"],
            registry=r,
        )
        self.restore_seconds = Histogram(
            f"{PREFIX}_cache_restore_seconds",
            "Time to restore a checkpoint into the KV caches, by tier.",
            ["tier"],
            buckets=RESTORE_BUCKETS,
            registry=r,
        )
        self.mlx_memory = Gauge(
            f"{PREFIX}_mlx_memory_bytes",
            "MLX memory as last read on the engine thread (at each scrape, between decode "
            "steps): active (in arrays), peak (since start) and cache (freed buffers kept for "
            "reuse, bounded by --mlx-cache-limit).",
            ["kind"],
            registry=r,
        )
        queue_depth = Gauge(f"{PREFIX}_queue_depth", "Requests waiting for the engine.", registry=r)
        queue_depth.set_function(lambda: sum(e.queued for e in engines()))
        running = Gauge(
            f"{PREFIX}_running_requests", "Requests decoding in the batch now.", registry=r
        )
        running.set_function(lambda: sum(e.running for e in engines()))
        for tier in TIERS:  # every series exists from the start, at 0
            self.lookups.labels("hit", tier)
            self.lookups.labels("failed", tier)
        self.lookups.labels("miss", "none")
        for tier in ("ram", "disk"):
            self.restores.labels(tier)
            self.restore_seconds.labels(tier)
        self.loads = Counter(
            f"{PREFIX}_model_loads", "Models loaded (on first use or again).", ["model"],
            registry=r,
        )  # fmt: skip
        self.unloads = Counter(
            f"{PREFIX}_model_unloads",
            "Models unloaded, by reason: idle (keep-alive), room (for another model), "
            "pressure (the system ran short of memory), request (asked to).",
            ["model", "reason"],
            registry=r,
        )
        self.pressure = Gauge(
            f"{PREFIX}_memory_pressure",
            "The system's memory pressure as last read: 0 normal, 1 warn, 2 critical.",
            registry=r,
        )
        self.pressure_actions = Counter(
            f"{PREFIX}_pressure_actions",
            "Steps taken for memory pressure: shrink (RAM tier and resident sessions of a "
            "model), unload (an idle model), restore (a model's budgets back at normal).",
            ["action"],
            registry=r,
        )
        for action in ("shrink", "unload", "restore"):
            self.pressure_actions.labels(action)
        loaded = Gauge(f"{PREFIX}_models_loaded", "Models resident in memory now.", registry=r)
        loaded.set_function(lambda: len(engines()))
        r.register(CacheCollector(engines))

    def observe_memory(self, stats: dict[str, int]) -> None:
        """Engine thread: the figures of `MemoryPolicy.stats()`."""
        for kind in ("active", "peak", "cache"):
            self.mlx_memory.labels(kind).set(stats[f"mlx_{kind}_bytes"])

    def observe_request(self, req: GenerationRequest, timings: Timings | None) -> None:
        """Engine thread, as each request finishes (timings is None if it failed or never
        ran), before its client gets the final event."""
        if timings is None:
            return
        t = timings
        self.generated_tokens.inc(t.completion_tokens)
        if t.completion_tokens > 0 and t.ttft_seconds > 0:
            self.ttft.observe(t.ttft_seconds)
        if t.completion_tokens > 1 and t.decode_seconds > 0:
            self.decode_tps.observe((t.completion_tokens - 1) / t.decode_seconds)
        for source, (drafted, accepted, passes) in t.by_source.items():
            self.drafted.labels(source).inc(drafted)
            self.accepted.labels(source).inc(accepted)
            self.verify_passes.labels(source).inc(passes)
        if t.cache_source == "fork":  # another choice of a request: its prompt is counted once
            return
        self.prompt_tokens.inc(t.prompt_tokens)
        self.cached_tokens.inc(t.cached_tokens)
        prefilled = t.prompt_tokens - t.cached_tokens
        if prefilled > 0 and t.prefill_seconds > 0:
            self.prefill_tps.observe(prefilled / t.prefill_seconds)
        if not self.cache_enabled:
            return
        if t.failed_source in TIERS:
            self.lookups.labels("failed", t.failed_source).inc()
        elif t.cache_source in TIERS:
            self.lookups.labels("hit", t.cache_source).inc()
        else:
            self.lookups.labels("miss", "none").inc()
        if t.cache_source in ("ram", "disk"):
            self.restores.labels(t.cache_source).inc()
            self.restore_seconds.labels(t.cache_source).observe(t.restore_seconds)


class CacheCollector(Collector):
    """The engines' busy time and the prompt caches' own counters (summed over loaded models
    and namespaces), read at each scrape. A model that unloads takes its counts along: the
    counters then reset, which Prometheus' rate() allows for."""

    def __init__(self, engines: Callable[[], list[Engine]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        engines = self.engines()
        yield CounterMetricFamily(
            f"{PREFIX}_engine_busy_seconds",
            "Time the engine threads spent serving requests (rate() of it is utilisation).",
            value=sum(e.busy_seconds for e in engines),
        )
        rooms = [e.room for e in engines if e.room is not None]
        yield GaugeMetricFamily(
            f"{PREFIX}_paused_requests",
            "Requests paused mid-decode because the KV budget was full, waiting to resume.",
            value=sum(len(room.paused) for room in rooms),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_request_pauses",
            "Times a decoding request was paused (checkpointed and freed) for memory.",
            value=sum(room.pauses for room in rooms),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_request_resumes",
            "Times a paused request was resumed from its checkpoint.",
            value=sum(room.resumes for room in rooms),
        )
        parts: dict[str, int] = {}
        for room in rooms:
            for name, value in room.last.items():  # a copy the engine thread made
                if name.endswith("_bytes"):
                    key = name.removesuffix("_bytes")
                    parts[key] = parts.get(key, 0) + value
        family = GaugeMetricFamily(
            f"{PREFIX}_kv_accounted_bytes",
            "Memory the admission ledger counts against --kv-budget, by part (as last read).",
            labels=["part"],
        )
        for name, value in parts.items():
            family.add_metric([name], value)
        yield family
        batches = [e.batch for e in engines if e.batch is not None]
        yield CounterMetricFamily(
            f"{PREFIX}_decode_steps",
            "Decode steps of the batch: one forward pass for every sequence decoding.",
            value=sum(batch.steps for batch in batches),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_decode_readbacks",
            "Reads of sampled tokens from the device: one per decode step for the whole batch, "
            "plus one for a grammar-constrained newcomer.",
            value=sum(batch.readbacks for batch in batches),
        )
        totals: dict[str, int] = {}
        for cache in (c for e in engines for c in caches_of(e.prompt_cache)):
            for name, value in cache.counters().items():
                totals[name] = totals.get(name, 0) + int(value)

        def get(name: str) -> int:
            return totals.get(name, 0)

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def gauge(name: str, doc: str, value: int) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield counter(
            "cache_read_bytes", "Bytes of checkpoint files read from disk to restore.",
            get("bytes_read"),
        )  # fmt: skip
        yield counter(
            "cache_written_bytes", "Bytes of checkpoint files written to disk.",
            get("bytes_written"),
        )  # fmt: skip
        yield counter(
            "cache_write_errors", "Checkpoint writes that failed (e.g. a full disk).",
            get("write_errors"),
        )  # fmt: skip
        evictions = CounterMetricFamily(
            f"{PREFIX}_cache_evictions",
            "Entries removed: budget (disk or RAM budget), dominated (a prefix of a newer "
            "entry), failed (failed to load, restore or prefill), suspect (failed its check "
            "after an unclean shutdown).",
            labels=["reason"],
        )
        evictions.add_metric(["budget"], get("evictions"))
        evictions.add_metric(["dominated"], get("pruned"))
        evictions.add_metric(["failed"], get("failure_evictions") - get("suspect_evictions"))
        evictions.add_metric(["suspect"], get("suspect_evictions"))
        yield evictions
        yield gauge("cache_disk_bytes", "Bytes of checkpoint files on disk.", get("disk_bytes"))
        yield gauge(
            "cache_disk_budget_bytes",
            "The disk tier's byte budget in force (lowered while the disk has less room).",
            get("disk_budget"),
        )
        yield gauge(
            "cache_disk_writes_failing",
            "Prompt caches whose last disk write failed (they serve from RAM meanwhile).",
            get("disk_writes_failing"),
        )
        yield gauge("cache_ram_bytes", "Bytes of checkpoints held in RAM.", get("ram_bytes"))
        yield gauge("cache_ram_budget_bytes", "The RAM tier's byte budget.", get("ram_budget"))
        yield gauge("cache_entries", "Checkpoints in the prompt cache.", get("entries"))
        lookups = CounterMetricFamily(
            f"{PREFIX}_cache_image_features_lookups",
            "Vision-encoder outputs looked up by image digest: hit (RAM or disk) or miss.",
            labels=["result"],
        )
        lookups.add_metric(["hit"], get("features_hits"))
        lookups.add_metric(["miss"], get("features_misses"))
        yield lookups
        yield counter(
            "cache_image_features_discarded",
            "Vision-encoder output files deleted unserved: torn, garbled or another model's.",
            get("features_discarded"),
        )
        yield gauge(
            "cache_image_features_disk_bytes",
            "Bytes of vision-encoder output files beside the checkpoints (within the budget).",
            get("features_disk_bytes"),
        )
        yield gauge(
            "cache_image_features_ram_bytes",
            "Bytes of vision-encoder outputs held in RAM.",
            get("features_ram_bytes"),
        )
