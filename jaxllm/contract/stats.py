"""The engine's stats: one typed tree, a frozen dataclass per part that counts, composed into `EngineStats`.

Each part produces its own snapshot: the core its `CoreStats` (requests, tokens, steps; the threaded Engine adds
what it queued and refused), a scheduler its `SchedulerStats` (queue and pool, with the host tier ledger's
`HostTierStats`, the lending ledger's `LendingStats` and speculative decoding's `SpeculativeStats`), the executor
its `ExecutorStats` (compiles, buckets, padding, the tuner's counters, with the host store's `HostStoreStats`). `EngineCore.stats()` composes the parts'
snapshots as they come; `LLM.stats()`, the threaded `Engine.stats()` and the Prometheus exporter
(`serve.metrics.register_engine_metrics`) read that tree, no field copied on the way.

How a leaf reaches /metrics is written once, in its field's metadata:
  counter(name, help) / gauge(name, help): exported as that metric. With labels=(...) the leaf is rows
      (label value, ..., value), one sample each; also=(series, ...): more series that carry the same value.
  exported(series, ...): samples of a labelled metric declared once below, which several leaves share.
  feeds(name, ...): read only by the `derived` properties that compute those metrics.
  unexported(why): not on /metrics, and why.
A metric computed from leaves (a ratio, a difference, a product across parts) is a property decorated
`@derived(series)` on the node that holds its inputs. `exports()` lists every metric with the leaves its samples
come from; the exporter registers exactly those, and tests/serve/test_metrics.py checks that every leaf reaches
/metrics (or says why not). Adding a counter is one edit here (the field and its metadata) plus the line in its
part that increments it.
"""

from __future__ import annotations

import dataclasses
import functools

__all__ = ["CoreStats", "EngineStats", "ExecutorStats", "Export", "HostStoreStats", "HostTierStats", "Leaf",
           "LendingStats", "Metric", "SchedulerStats", "Series", "SpeculativeStats", "counters", "exports", "leaves",
           "read", "since"]

KINDS = ("counter", "gauge")


@dataclasses.dataclass(frozen=True)
class Metric:
    """One Prometheus metric: name, type ("counter" or "gauge"), help text and label names."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"metric {self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "labels", tuple(self.labels))

    def at(self, **labels: str) -> Series:
        """This metric's series with these label values (every label named)."""
        if set(labels) != set(self.labels):
            raise ValueError(f"metric {self.name} takes labels {self.labels}, got {tuple(labels)}")
        return Series(self, tuple(str(labels[n]) for n in self.labels))


@dataclasses.dataclass(frozen=True)
class Series:
    """Where a leaf's value goes: a metric, and its label values; () for an unlabelled metric or a leaf of rows."""

    metric: Metric
    label_values: tuple[str, ...] = ()


def _field(kind: str, default, *, series=(), feeds=(), why: str | None = None):
    return dataclasses.field(default=default, metadata=dict(kind=kind, series=tuple(series), feeds=tuple(feeds),
                                                            unexported=why))


def counter(name: str, help_text: str, *, labels: tuple[str, ...] = (), default=0, also: tuple[Series, ...] = ()):
    """A leaf exported as the counter `name` (labels: the leaf is rows, (label values..., value))."""
    return _field("counter", default, series=(Series(Metric(name, "counter", help_text, labels)), *also))


def gauge(name: str, help_text: str, *, labels: tuple[str, ...] = (), default=0, also: tuple[Series, ...] = ()):
    """A leaf exported as the gauge `name`."""
    return _field("gauge", default, series=(Series(Metric(name, "gauge", help_text, labels)), *also))


def exported(*series: Series, default=0):
    """A leaf exported as these series of metrics declared elsewhere (one sample of a labelled metric each)."""
    return _field(series[0].metric.kind, default, series=series)


def feeds(*names: str, kind: str, default=0):
    """A leaf that only the derived metrics `names` read."""
    return _field(kind, default, feeds=names)


def unexported(why: str, *, kind: str, default=0):
    """A leaf not on /metrics, and why."""
    return _field(kind, default, why=why)


class _Derived(property):
    def __init__(self, fget, series: tuple[Series, ...]):
        super().__init__(fget, doc=fget.__doc__)
        self.series = series


def derived(*series: Series):
    """A property exported as `series`, computed from its node's leaves."""
    return lambda fget: _Derived(fget, series)


# Metrics that several leaves share, one labelled sample each.
KV_TIER_BLOCKS = Metric("jaxllm_kv_tier_blocks", "gauge",
                        "KV rBlocks each tier has (tier: device = the pool, host = the host tier)", ("tier",))
KV_TIER_USED_BLOCKS = Metric("jaxllm_kv_tier_used_blocks", "gauge",
                             "KV rBlocks in use per tier (the host's: swapped sequences and its prefix cache)",
                             ("tier",))
KV_TIER_USED_BYTES = Metric("jaxllm_kv_tier_used_bytes", "gauge",
                            "bytes of KV in use per tier (the host's: what its copied runs hold)", ("tier",))
KV_HOST_COPIED_BLOCKS = Metric("jaxllm_kv_host_copied_blocks_total", "counter",
                               "KV rBlocks copied between the tiers (direction: out = to the host, in = back)",
                               ("direction",))
KV_HOST_COPY_SECONDS = Metric("jaxllm_kv_host_copy_seconds_total", "counter",
                              "seconds each direction had a copy between the tiers in flight", ("direction",))



# ----- the parts -----

class _Part:
    """A part's snapshots add up leaf by leaf (numbers add, tuples join, nested parts add alike): several
    instances' schedulers or host tiers give one."""

    def __add__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return dataclasses.replace(self, **{f.name: getattr(self, f.name) + getattr(other, f.name)
                                            for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True)
class CoreStats(_Part):
    """The core's counters since start-up (EngineCore; requests_rejected: the threaded Engine's queue).

    ttft/tpot: count and sum of per-request samples (seconds); their mean is sum / count.
    """

    requests_total: int = counter("jaxllm_engine_requests_total", "requests the engine admitted (every front end's)")
    requests_finished: int = counter("jaxllm_engine_requests_finished_total",
                                     "requests that ended other than by a cancel (a stop, EOS, the length limit)")
    requests_cancelled: int = counter("jaxllm_engine_requests_cancelled_total",
                                      "requests cancelled (client gone, deadline, shutdown)")
    requests_rejected: int = counter("jaxllm_engine_requests_rejected_total",
                                     "requests refused because the queue was full")
    prompt_tokens_total: int = counter("jaxllm_prompt_tokens_total", "prompt tokens accepted")
    generated_tokens_total: int = counter("jaxllm_generation_tokens_total", "tokens generated")
    steps_total: int = counter("jaxllm_engine_steps_total", "engine steps run")
    ttft_count: int = counter("jaxllm_engine_time_to_first_token_seconds_count",
                              "requests timed to their first token, inside the engine")
    ttft_sum_s: float = counter("jaxllm_engine_time_to_first_token_seconds_sum",
                                "seconds from admission to the first token, summed over those requests", default=0.0)
    tpot_count: int = counter("jaxllm_engine_time_per_output_token_seconds_count",
                              "requests timed per output token after the first, inside the engine")
    tpot_sum_s: float = counter("jaxllm_engine_time_per_output_token_seconds_sum",
                                "mean seconds per output token after the first, summed over those requests",
                                default=0.0)


@dataclasses.dataclass(frozen=True)
class LendingStats(_Part):
    """The DistKV ledger across instances (all 0 on one instance): rBlocks borrowed now per instance, instances
    lending now, and rBlocks lent / recalled home and circular-debt swaps so far."""

    borrowed_by_instance: tuple[int, ...] = feeds("jaxllm_kv_borrowed_blocks", kind="gauge", default=())
    lending_instances: int = gauge("jaxllm_kv_lending_instances", "instances lending rBlocks to others now")
    loans_total: int = counter("jaxllm_kv_loans_total", "rBlocks lent between instances")
    recalled_blocks_total: int = counter("jaxllm_kv_recalled_blocks_total",
                                         "lent rBlocks copied home when their debtor had room again")
    swapped_pairs_total: int = counter("jaxllm_kv_swapped_pairs_total", "circular debts broken by swapping two rBlocks")

    @derived(Metric("jaxllm_kv_borrowed_blocks", "gauge",
                    "KV rBlocks instances hold on other instances now (DistKV lending)").at())
    def borrowed_blocks(self) -> int:
        return sum(self.borrowed_by_instance)


@dataclasses.dataclass(frozen=True)
class HostTierStats(_Part):
    """A snapshot of one host tier's ledger (or the sum of several; all 0 without one): its slots (rBlocks) and
    what moved so far."""

    blocks: int = exported(KV_TIER_BLOCKS.at(tier="host"))  # slots (rBlocks) the tier has
    blocks_used: int = exported(KV_TIER_USED_BLOCKS.at(tier="host"))  # held by swapped sequences or cached prefixes
    cached_blocks: int = gauge("jaxllm_host_cache_blocks", "KV rBlocks the host tier's prefix cache holds")
    swapped_sequences: int = gauge("jaxllm_host_swapped_sequences", "preempted sequences whose KV waits in the host tier")
    swap_outs_total: int = counter("jaxllm_kv_swap_outs_total",
                                   "preempted sequences swapped to the host tier instead of recomputed")
    swap_ins_total: int = counter("jaxllm_kv_swap_ins_total", "swapped sequences copied back from the host tier")
    swap_fallbacks_total: int = counter("jaxllm_kv_swap_fallbacks_total",
                                        "preempted sequences recomputed because the host tier was full")
    blocks_out_total: int = exported(KV_HOST_COPIED_BLOCKS.at(direction="out"))  # swaps and prefix-cache spills
    blocks_in_total: int = exported(KV_HOST_COPIED_BLOCKS.at(direction="in"))  # swaps and prefix-cache hits
    spilled_blocks_total: int = counter("jaxllm_host_cache_spilled_blocks_total",
                                        "prefix-cache rBlocks the device evicted and the host kept")
    hit_blocks_total: int = counter("jaxllm_host_cache_hit_blocks_total",
                                    "host prefix-cache rBlocks copied back instead of prefilled")
    swap_cached_blocks_total: int = counter("jaxllm_kv_swap_cached_blocks_total",
                                            "swapped rBlocks the host prefix cache held already (not copied out again)")


@dataclasses.dataclass(frozen=True)
class SpeculativeStats(_Part):
    """Speculative decoding's verify steps so far (all 0 without it; the steps themselves are the executor's
    bucket_steps of kind "verify"), vLLM's metrics: draft tokens proposed, draft tokens accepted, and drafts (a
    sequence's draft checked in one verify step)."""

    draft_tokens_total: int = counter("jaxllm_spec_decode_num_draft_tokens_total",
                                      "draft tokens proposed and checked by verify steps")
    accepted_tokens_total: int = counter("jaxllm_spec_decode_num_accepted_tokens_total",
                                         "draft tokens the target model accepted")
    drafts_total: int = counter("jaxllm_spec_decode_num_drafts_total",
                                "drafts checked (one per sequence with draft tokens in a verify step)")

    @derived(Metric("jaxllm_spec_decode_acceptance_rate", "gauge",
                    "accepted draft tokens / draft tokens proposed, so far").at())
    def acceptance_rate(self) -> float:
        return self.accepted_tokens_total / self.draft_tokens_total if self.draft_tokens_total else 0.0

    @derived(Metric("jaxllm_spec_decode_mean_acceptance_length", "gauge",
                    "tokens a draft gave on average (its accepted tokens + the one the verify step draws)").at())
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens_total / self.drafts_total if self.drafts_total else 0.0


@dataclasses.dataclass(frozen=True)
class SchedulerStats(_Part):
    """A snapshot of a scheduler's queue and pool (several instances' summed), its lending ledger and host tier."""

    waiting: int = gauge("jaxllm_queue_depth", "requests waiting to run")
    running: int = gauge("jaxllm_running_requests", "requests in the running batch")
    preemptions: int = counter("jaxllm_preemptions_total",
                               "sequences preempted (rBlocks freed: swapped to the host tier, or recomputed later)")
    cached_tokens: int = counter("jaxllm_prefix_cache_hit_tokens_total",  # all admissions together
                                 "tokens whose KV came from the prefix cache instead of a prefill")
    pool_blocks: int = gauge("jaxllm_kv_pool_blocks", "KV rBlocks in the pool",
                             also=(KV_TIER_BLOCKS.at(tier="device"),))
    pool_blocks_free: int = feeds("jaxllm_kv_pool_usage_ratio", "jaxllm_kv_tier_used_blocks",
                                  "jaxllm_kv_tier_used_bytes", kind="gauge")  # cached rBlocks nobody holds count
    cached_blocks: int = gauge("jaxllm_prefix_cache_blocks",
                               "full KV rBlocks registered in the prefix cache (held or evictable)")
    lending: LendingStats = dataclasses.field(default_factory=LendingStats)
    host: HostTierStats = dataclasses.field(default_factory=HostTierStats)
    speculative: SpeculativeStats = dataclasses.field(default_factory=SpeculativeStats)

    @derived(Metric("jaxllm_kv_pool_usage_ratio", "gauge", "fraction of KV rBlocks in use").at())
    def pool_usage(self) -> float:
        """Fraction of rBlocks in use."""
        return 1.0 - self.pool_blocks_free / self.pool_blocks if self.pool_blocks else 0.0

    @derived(KV_TIER_USED_BLOCKS.at(tier="device"))
    def pool_blocks_used(self) -> int:
        return self.pool_blocks - self.pool_blocks_free


@dataclasses.dataclass(frozen=True)
class HostStoreStats(_Part):
    """The executor's host store (all 0 without a host tier): host bytes its runs hold, and seconds each direction
    had a copy in flight (from a copy's start to its landing; copies in flight together counted once)."""

    bytes_used: int = exported(KV_TIER_USED_BYTES.at(tier="host"))
    copy_out_seconds: float = exported(KV_HOST_COPY_SECONDS.at(direction="out"), default=0.0)
    copy_in_seconds: float = exported(KV_HOST_COPY_SECONDS.at(direction="in"), default=0.0)


@dataclasses.dataclass(frozen=True)
class ExecutorStats(_Part):
    """What the executor compiled and ran (served steps: warm-up's not counted).

    compile_count: step-function traces (each a compile); xla_compiles: the XLA compiles behind them (a read from
    the persistent compilation cache is a persistent_cache_hit instead). bucket_steps: ((kind "decode" |
    "prefill", padded size, steps), ...); padding_tokens_total: padded minus real tokens over those steps; tuner:
    the StepTuner's stats(), ((name, value), ...). kv_block_bytes: one rBlock's bytes, all layers.
    """

    compile_count: int = counter("jaxllm_compiles_total",
                                 "step functions compiled (flat after warm-up when shapes are covered)")
    xla_compiles: int = counter("jaxllm_xla_compiles_total",
                                "executables XLA compiled for engine steps (not persistent-cache reads)")
    persistent_cache_hits: int = counter("jaxllm_persistent_cache_hits_total",
                                         "step executables read from the persistent compilation cache")
    bucket_steps: tuple[tuple[str, int, int], ...] = counter(
        "jaxllm_bucket_steps_total", "steps served per shape bucket (kind decode|prefill, padded size)",
        labels=("kind", "size"), default=())
    padding_tokens_total: int = counter("jaxllm_padding_tokens_total",
                                        "padding tokens run: padded minus real tokens, over served steps")
    tuner: tuple[tuple[str, int], ...] = counter(
        "jaxllm_tuner_events_total", "the step tuner's counters (stat: predictions, cache_hits, ...)",
        labels=("stat",), default=())
    dist_steps_total: int = counter("jaxllm_dist_attention_steps_total",
                                    "steps that ran DistAttention (some sequence had borrowed rBlocks)")
    kv_block_bytes: int = feeds("jaxllm_kv_tier_used_bytes", kind="gauge")
    host_store: HostStoreStats = dataclasses.field(default_factory=HostStoreStats)


@dataclasses.dataclass(frozen=True)
class EngineStats(_Part):
    """A snapshot of the whole engine: counters since start-up and the current load, one part each."""

    core: CoreStats = dataclasses.field(default_factory=CoreStats)
    scheduler: SchedulerStats = dataclasses.field(default_factory=SchedulerStats)
    executor: ExecutorStats = dataclasses.field(default_factory=ExecutorStats)

    @derived(KV_TIER_USED_BYTES.at(tier="device"))
    def pool_bytes_used(self) -> int:
        """Bytes of KV the pool's rBlocks in use hold."""
        return self.scheduler.pool_blocks_used * self.executor.kv_block_bytes


# ----- walking the tree -----

@dataclasses.dataclass(frozen=True)
class Leaf:
    """A leaf of the tree (or a derived property): its path from the root and how it reaches /metrics."""

    path: tuple[str, ...]
    kind: str
    series: tuple[Series, ...] = ()
    feeds: tuple[str, ...] = ()
    unexported: str | None = None
    derived: bool = False


@dataclasses.dataclass(frozen=True)
class Export:
    """One metric and its samples' sources: (leaf path, series) each."""

    metric: Metric
    sources: tuple[tuple[tuple[str, ...], Series], ...]


def leaves(cls: type = EngineStats) -> list[Leaf]:
    """Every leaf field under `cls` and every derived property, depth first in field order; TypeError for a field
    without metric metadata (this module's counter / gauge / exported / feeds / unexported)."""
    out: list[Leaf] = []

    def walk(node, path: tuple[str, ...]) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, path + (f.name,))
            elif "kind" not in f.metadata:
                raise TypeError(f"stats field {'.'.join(path + (f.name,))} says nothing of /metrics: give it "
                                f"counter(), gauge(), exported(), feeds() or unexported() (jaxllm.contract.stats)")
            else:
                m = f.metadata
                out.append(Leaf(path + (f.name,), m["kind"], m["series"], m["feeds"], m["unexported"]))
        for name, attr in vars(type(node)).items():
            if isinstance(attr, _Derived):
                out.append(Leaf(path + (name,), attr.series[0].metric.kind, attr.series, derived=True))

    walk(cls(), ())
    return out


def exports(cls: type = EngineStats) -> list[Export]:
    """Every metric the tree exports, in walk order, with where its samples come from. ValueError when two leaves
    declare one name differently, an unlabelled metric has two sources or a label set comes twice."""
    found: dict[str, list] = {}
    for leaf in leaves(cls):
        for series in leaf.series:
            metric, sources = found.setdefault(series.metric.name, [series.metric, []])
            if metric != series.metric:
                raise ValueError(f"metric {metric.name} is declared twice, differently: {metric} and {series.metric}")
            sources.append((leaf.path, series))
    out = []
    for metric, sources in found.values():
        keys = [s.label_values for _, s in sources]
        if (not metric.labels and len(sources) > 1) or len(set(keys)) < len(keys):
            raise ValueError(f"metric {metric.name} has clashing sources: {[p for p, _ in sources]}")
        out.append(Export(metric, tuple(sources)))
    return out


def read(tree, path: tuple[str, ...]):
    """The value at `path` in a tree (a leaf, a derived property or a part)."""
    return functools.reduce(getattr, path, tree)


def since(now, before):
    """A snapshot's counters since an earlier one of the same tree (counter leaves subtracted, gauges and leaves of
    rows as they are now): what a benchmark's timed pass did."""
    changes = {}
    for f in dataclasses.fields(now):
        value, earlier = getattr(now, f.name), getattr(before, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = since(value, earlier)
        elif f.metadata.get("kind") == "counter" and isinstance(value, (int, float)):
            changes[f.name] = value - earlier
    return dataclasses.replace(now, **changes)


def counters(cls: type) -> dict[str, int | float]:
    """A part's counter leaves at their zero ({name: default}): the dict a producer increments and builds its
    snapshot from, so a new counter needs no third edit."""
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.metadata.get("kind") == "counter" and isinstance(f.default, (int, float))}
