"""Prometheus metrics of the server (vLLM's names with a `dosa_` prefix), and the estimate of
the indexer's share of a prefill that one of them reports."""

import copy

import prometheus_client as prom

from model.buckets import chunk_plan, length_bucket
from model.costs import countable, prefill_counts

# TTFT of a long prefill on a CPU runs to minutes: buckets from 1 ms to 320 s.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0, 160.0, 320.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                5.12, 10.24)

RECALL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.97,
                  0.98, 0.99, 0.995, 0.999, 1.0)


def context_bucket(n_tokens):
    """The TTFT label for a prompt of n tokens: its length bucket (model.buckets)."""
    return str(length_bucket(n_tokens))


def indexer_prefill_share(config, start, n):
    """Estimated fraction of a prefill's FLOPs spent in the lightning indexer, for n tokens
    at positions start..start+n-1 of a model with ModelConfig `config`.

    An estimate from FLOP counts, not a timing: the indexer runs inside one jitted prefill,
    where it cannot be timed apart. The counts are the cost model's (model.costs: each
    selection kind's own work from the selection table, plus the indexer's projections,
    against attention, projections, MLP and head), over the chunks the runner prefills,
    with masked work skipped as the GPU kernels do. Sorting and top-k carry no FLOPs.
    None when the cost model cannot count the model (model.costs.countable).
    """
    if not countable(config):
        return None
    chunks = chunk_plan(n, start=start, capacity=length_bucket(start + n),
                        chunk=config.prefill_chunk)
    counts = prefill_counts(config, start + n, skip=True, chunks=chunks)
    indexer = rest = 0.0
    for layer, kind in enumerate(counts.layers):
        attention = "attention" if config.layer_is_sparse(layer) else "dense_attention"
        for op in counts.per_layer[kind]:
            if op.stage == "indexer" or op.name == "indexer projections":
                indexer += op.flops
            elif op.stage in ("other", attention):
                rest += op.flops
    rest += sum(op.flops for op in counts.head)
    return indexer / (indexer + rest)


class Metrics:
    """Every metric of one server, in its own registry (several servers can share a process)."""

    def __init__(self, model_version, indexer):
        self.registry = reg = prom.CollectorRegistry()
        self.labels = dict(model_version=model_version)
        self.indexer = indexer
        by_version = ["model_version"]
        self.ttft = prom.Histogram(
            "dosa_time_to_first_token_seconds",
            "Request arrival to the first generated token available to the caller.",
            ["model_version", "indexer", "context_bucket"], buckets=TTFT_BUCKETS, registry=reg)
        self.inter_token = prom.Histogram(
            "dosa_inter_token_latency_seconds", "Time between two generated tokens of a request.",
            by_version, buckets=STEP_BUCKETS, registry=reg)
        self.queue_time = prom.Histogram(
            "dosa_request_queue_time_seconds", "Arrival to the start of the request's prefill.",
            by_version, buckets=TTFT_BUCKETS, registry=reg)
        self.prefill_time = prom.Histogram(
            "dosa_request_prefill_time_seconds",
            "Start of the prefill to its first token (chunks interleaved with decode steps).",
            by_version, buckets=TTFT_BUCKETS, registry=reg)
        self.e2e = prom.Histogram(
            "dosa_e2e_request_latency_seconds", "Arrival to the end of the response.",
            by_version, buckets=TTFT_BUCKETS, registry=reg)
        self.indexer_share = prom.Gauge(
            "dosa_indexer_prefill_share",
            "Indexer share of the last prefill, ESTIMATED from FLOP counts of the config "
            "(indexer projections and scoring vs projections, attention and MLP; "
            "serving.metrics.indexer_prefill_share), not timed.", by_version, registry=reg)
        self.cache_hit_rate = prom.Gauge(
            "dosa_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.",
            by_version, registry=reg)
        self.cache_queries = prom.Counter(
            "dosa_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            by_version, registry=reg)
        self.cache_hits = prom.Counter(
            "dosa_prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).",
            by_version, registry=reg)
        self.cache_bytes = prom.Gauge(
            "dosa_prefix_cache_bytes", "Bytes held by the prefix cache, by part (kv: keys and "
            "values; index: indexer keys and block summaries).", ["model_version", "part"],
            registry=reg)
        self.cache_bytes_per_token = prom.Gauge(
            "dosa_prefix_cache_bytes_per_token", "Bytes per cached token, by part (kv, index).",
            ["model_version", "part"], registry=reg)
        self.cache_blocks = prom.Gauge(
            "dosa_prefix_cache_blocks", "Blocks held by the prefix cache.", by_version,
            registry=reg)
        self.cache_pages = prom.Gauge(
            "dosa_cache_pages", "Pages of the paged cache (cache_layout: paged), by state: "
            "in_use (held by a running request), shared (held by more than one: a cached "
            "prompt prefix), cached (held by none, kept for later prompts), free.",
            ["model_version", "state"], registry=reg)
        self.running = prom.Gauge(
            "dosa_num_requests_running", "Requests prefilling or decoding.", by_version,
            registry=reg)
        self.waiting = prom.Gauge(
            "dosa_num_requests_waiting", "Admitted requests waiting for a decode slot.",
            by_version, registry=reg)
        self.requests = prom.Counter(
            "dosa_requests", "Finished requests by HTTP status.", ["model_version", "status"],
            registry=reg)
        self.errors = prom.Counter(
            "dosa_request_errors", "Requests that ended in an error, by HTTP status (an "
            "error inside a stream counts with the status it would have had).",
            ["model_version", "status"], registry=reg)
        self.generated_tokens = prom.Counter(
            "dosa_generation_tokens", "Generated tokens.", by_version, registry=reg)
        self.prompt_tokens = prom.Counter(
            "dosa_prompt_tokens", "Prompt tokens of admitted requests.", by_version, registry=reg)
        self.prefill_seconds = prom.Counter(
            "dosa_prefill_seconds", "Wall time of prefill steps (chunks, device work "
            "included; a watched chunk's capturing step too).", by_version, registry=reg)
        by_layer = ["model_version", "layer"]
        self.selection_recall = prom.Histogram(
            "dosa_selection_recall", "Shadow recall of the deployed selection against flat "
            "top_k on the same indexer inputs, one observation per watched prefill chunk and "
            "layer (mean over its sampled query rows); layer: the full layer whose selection "
            "it is (shared layers attend to it).", by_layer, buckets=RECALL_BUCKETS,
            registry=reg)
        self.selection_iou = prom.Histogram(
            "dosa_selection_iou", "Shadow IoU of the deployed selection with flat top_k (as "
            "dosa_selection_recall).", by_layer, buckets=RECALL_BUCKETS, registry=reg)
        self.shadow_rows = prom.Counter(
            "dosa_shadow_rows", "Query rows whose selection was checked against flat (each "
            "counts once for every watched layer).", by_version, registry=reg)
        self.shadow_seconds = prom.Counter(
            "dosa_shadow_seconds", "Wall time of the shadow work (flat re-selection of the "
            "sampled rows, copies, recall/IoU); the cost of watching.", by_version,
            registry=reg)
        self.rollout_changes = prom.Counter(
            "dosa_rollout_changes", "Rollout changes (promote, rollback, set_share, "
            "guard_rollback).", ["action"], registry=reg)
        self.memory_maps = prom.Gauge(
            "dosa_memory_maps", "Memory mappings the server process holds (held; compiled "
            "programs hold most) and the kernel's cap on them (cap: vm.max_map_count), as "
            "of the last compile (serving.program_maps).", ["kind"], registry=reg)
        self.program_drops = prom.Counter(
            "dosa_compiled_program_drops", "Times the server dropped its compiled programs "
            "to stay under the memory-map cap (each compiles again on its next use).",
            registry=reg)
        self._drops_counted = 0
        self._init_version()

    def _init_version(self):
        self._hits = self._queries = 0
        for gauge in (self.running, self.waiting, self.cache_blocks, self.cache_hit_rate):
            gauge.labels(**self.labels).set(0)

    def for_version(self, model_version, indexer):
        """The same metrics (one registry) recorded under another model_version label and
        TTFT indexer label: one view per side of a canary rollout."""
        view = copy.copy(self)
        view.labels = dict(model_version=model_version)
        view.indexer = indexer
        view._init_version()
        return view

    def observe_shadow(self, record):
        """A serving.shadow.ShadowRecord of a watched chunk."""
        for layer, recall, iou in zip(record.layers, record.recall, record.iou):
            self.selection_recall.labels(layer=str(layer), **self.labels).observe(recall)
            self.selection_iou.labels(layer=str(layer), **self.labels).observe(iou)
        self.shadow_rows.labels(**self.labels).inc(len(record.positions) * len(record.layers))
        self.shadow_seconds.labels(**self.labels).inc(record.seconds)

    def observe_ttft(self, seconds, prompt_tokens):
        self.ttft.labels(indexer=self.indexer, context_bucket=context_bucket(prompt_tokens),
                         **self.labels).observe(seconds)

    def observe_cache_lookup(self, queried, hit):
        self.cache_queries.labels(**self.labels).inc(queried)
        self.cache_hits.labels(**self.labels).inc(hit)
        self._queries += queried
        self._hits += hit
        if self._queries:
            self.cache_hit_rate.labels(**self.labels).set(self._hits / self._queries)

    def set_cache_usage(self, usage):
        """usage: PrefixCache.usage() (blocks, bytes and bytes per token by part)."""
        self.cache_blocks.labels(**self.labels).set(usage["blocks"])
        for part in ("kv", "index"):
            self.cache_bytes.labels(part=part, **self.labels).set(usage[f"{part}_bytes"])
            self.cache_bytes_per_token.labels(part=part, **self.labels).set(
                usage[f"{part}_bytes_per_token"])

    def set_page_counts(self, counts):
        """A PagePool's counts (serving.page_pool.PagePool.counts)."""
        for state, n in counts.items():
            self.cache_pages.labels(state=state, **self.labels).set(n)

    def set_memory_maps(self, held, cap, drops):
        """serving.program_maps.MapBudget's figures (a process's, not a side's)."""
        self.memory_maps.labels(kind="held").set(held)
        self.memory_maps.labels(kind="cap").set(cap)
        if drops > self._drops_counted:
            self.program_drops.inc(drops - self._drops_counted)
            self._drops_counted = drops

    def finished(self, status):
        self.requests.labels(status=str(status), **self.labels).inc()
        if status >= 400:
            self.errors.labels(status=str(status), **self.labels).inc()

    def exposition(self):
        return prom.generate_latest(self.registry)
