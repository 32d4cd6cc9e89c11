"""The engine's /metrics series: exactly the set they were when the exporter listed them by hand (names, types,
labels, help), and every leaf of the stats tree (jaxllm.contract.stats) reaching them, or saying why not."""

from __future__ import annotations

import dataclasses
import types

import pytest

from jaxllm.contract import EngineStats, stats
from jaxllm.engine.core import EngineInfo
from serve.metrics import Registry, parse, register_engine_metrics

# What register_engine_metrics serves: name -> (type, label names, help). Changing one breaks dashboards and
# alerts; a new metric is added here on purpose.
ENGINE_METRICS = {
    "jaxllm_bucket_steps_total": ("counter", ('kind', 'size'),
                                  'steps served per shape bucket (kind decode|prefill, padded size)'),
    "jaxllm_compiles_total": ("counter", (), 'step functions compiled (flat after warm-up when shapes are covered)'),
    "jaxllm_dist_attention_steps_total": ("counter", (),
                                          'steps that ran DistAttention (some sequence had borrowed rBlocks)'),
    "jaxllm_engine_requests_cancelled_total": ("counter", (), 'requests cancelled (client gone, deadline, shutdown)'),
    "jaxllm_engine_requests_rejected_total": ("counter", (), 'requests refused because the queue was full'),
    "jaxllm_engine_requests_total": ("counter", (), "requests the engine admitted (every front end's)"),
    "jaxllm_engine_requests_finished_total": ("counter", (),
                                              'requests that ended other than by a cancel (a stop, EOS, the length limit)'),
    "jaxllm_engine_time_to_first_token_seconds_count": ("counter", (),
                                                        'requests timed to their first token, inside the engine'),
    "jaxllm_engine_time_to_first_token_seconds_sum": ("counter", (),
        'seconds from admission to the first token, summed over those requests'),
    "jaxllm_engine_time_per_output_token_seconds_count": ("counter", (),
        'requests timed per output token after the first, inside the engine'),
    "jaxllm_engine_time_per_output_token_seconds_sum": ("counter", (),
        'mean seconds per output token after the first, summed over those requests'),
    "jaxllm_engine_steps_total": ("counter", (), 'engine steps run'),
    "jaxllm_generation_tokens_total": ("counter", (), 'tokens generated'),
    "jaxllm_host_cache_blocks": ("gauge", (), "KV rBlocks the host tier's prefix cache holds"),
    "jaxllm_host_swapped_sequences": ("gauge", (), 'preempted sequences whose KV waits in the host tier'),
    "jaxllm_host_cache_hit_blocks_total": ("counter", (), 'host prefix-cache rBlocks copied back instead of prefilled'),
    "jaxllm_host_cache_spilled_blocks_total": ("counter", (),
                                               'prefix-cache rBlocks the device evicted and the host kept'),
    "jaxllm_kv_borrowed_blocks": ("gauge", (), 'KV rBlocks instances hold on other instances now (DistKV lending)'),
    "jaxllm_kv_host_copied_blocks_total": ("counter", ('direction',),
        'KV rBlocks copied between the tiers (direction: out = to the host, in = back)'),
    "jaxllm_kv_host_copy_seconds_total": ("counter", ('direction',),
                                          'seconds each direction had a copy between the tiers in flight'),
    "jaxllm_kv_lending_instances": ("gauge", (), 'instances lending rBlocks to others now'),
    "jaxllm_kv_loans_total": ("counter", (), 'rBlocks lent between instances'),
    "jaxllm_kv_pool_blocks": ("gauge", (), 'KV rBlocks in the pool'),
    "jaxllm_kv_pool_usage_ratio": ("gauge", (), 'fraction of KV rBlocks in use'),
    "jaxllm_kv_recalled_blocks_total": ("counter", (), 'lent rBlocks copied home when their debtor had room again'),
    "jaxllm_kv_swap_cached_blocks_total": ("counter", (),
                                           'swapped rBlocks the host prefix cache held already (not copied out again)'),
    "jaxllm_kv_swap_fallbacks_total": ("counter", (), 'preempted sequences recomputed because the host tier was full'),
    "jaxllm_kv_swap_ins_total": ("counter", (), 'swapped sequences copied back from the host tier'),
    "jaxllm_kv_swap_outs_total": ("counter", (), 'preempted sequences swapped to the host tier instead of recomputed'),
    "jaxllm_kv_swapped_pairs_total": ("counter", (), 'circular debts broken by swapping two rBlocks'),
    "jaxllm_kv_tier_blocks": ("gauge", ('tier',),
                              'KV rBlocks each tier has (tier: device = the pool, host = the host tier)'),
    "jaxllm_kv_tier_used_blocks": ("gauge", ('tier',),
                                   "KV rBlocks in use per tier (the host's: swapped sequences and its prefix cache)"),
    "jaxllm_kv_tier_used_bytes": ("gauge", ('tier',),
                                  "bytes of KV in use per tier (the host's: what its copied runs hold)"),
    "jaxllm_mesh_devices": ("gauge", (), 'the mesh: devices the mesh spans'),
    "jaxllm_mesh_instances": ("gauge", (), "the mesh: serving instances on the mesh's instance axis"),
    "jaxllm_mesh_processes": ("gauge", (), 'the mesh: JAX processes (hosts) running the program'),
    "jaxllm_mesh_tensor_parallel": ("gauge", (), 'the mesh: devices one model is split over'),
    "jaxllm_padding_tokens_total": ("counter", (), 'padding tokens run: padded minus real tokens, over served steps'),
    "jaxllm_persistent_cache_hits_total": ("counter", (),
                                           'step executables read from the persistent compilation cache'),
    "jaxllm_preemptions_total": ("counter", (),
                                 'sequences preempted (rBlocks freed: swapped to the host tier, or recomputed later)'),
    "jaxllm_prefix_cache_blocks": ("gauge", (), 'full KV rBlocks registered in the prefix cache (held or evictable)'),
    "jaxllm_prefix_cache_hit_tokens_total": ("counter", (),
                                             'tokens whose KV came from the prefix cache instead of a prefill'),
    "jaxllm_prompt_tokens_total": ("counter", (), 'prompt tokens accepted'),
    "jaxllm_queue_depth": ("gauge", (), 'requests waiting to run'),
    "jaxllm_ready": ("gauge", (), '1 once the model is loaded and warm'),
    "jaxllm_spec_decode_acceptance_rate": ("gauge", (), 'accepted draft tokens / draft tokens proposed, so far'),
    "jaxllm_spec_decode_mean_acceptance_length": ("gauge", (),
        "tokens a draft gave on average (its accepted tokens + the one the verify step draws)"),
    "jaxllm_spec_decode_num_accepted_tokens_total": ("counter", (), 'draft tokens the target model accepted'),
    "jaxllm_spec_decode_num_draft_tokens_total": ("counter", (), 'draft tokens proposed and checked by verify steps'),
    "jaxllm_spec_decode_num_drafts_total": ("counter", (),
        'drafts checked (one per sequence with draft tokens in a verify step)'),
    "jaxllm_running_requests": ("gauge", (), 'requests in the running batch'),
    "jaxllm_tuner_events_total": ("counter", ('stat',),
                                  "the step tuner's counters (stat: predictions, cache_hits, ...)"),
    "jaxllm_xla_compiles_total": ("counter", (),
                                  'executables XLA compiled for engine steps (not persistent-cache reads)'),
}

# Leaves of the tree that do not reach /metrics (their metadata says why): none; a new leaf goes on /metrics or,
# with its reason, here.
UNEXPORTED: set[str] = set()

INFO = EngineInfo(model="tiny", architecture="tiny", dtype="float32", kv_dtype="float32", context_limit=64,
                  vocab_size=259, num_layers=1, hidden_size=8, num_heads=1, num_kv_heads=1, block_size=8, num_blocks=8,
                  max_seqs=2, max_tokens_per_step=8)


def _render(tree: EngineStats | None) -> str:
    engine = None if tree is None else types.SimpleNamespace(stats=lambda: tree, info=lambda: INFO)
    registry = Registry()
    register_engine_metrics(registry, lambda: engine)
    return registry.render()


def _declared(text: str) -> dict[str, tuple[str, tuple[str, ...], str]]:
    """{name: (type, label names, help)} of an exposition (label names from its samples)."""
    helps, kinds, labels = {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[len("# HELP "):].split(" ", 1)
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split(" ")
            kinds[name] = kind
        elif line:
            sample = line.rpartition(" ")[0]
            name, _, rest = sample.partition("{")
            labels[name] = tuple(part.split("=")[0] for part in rest.rstrip("}").split(",")) if rest else ()
    return {name: (kinds[name], labels.get(name, ()), helps[name]) for name in helps}


def _leaf_paths() -> list[stats.Leaf]:
    return [leaf for leaf in stats.leaves() if not leaf.derived]


def _replace_at(node, path: tuple[str, ...], value):
    if len(path) == 1:
        return dataclasses.replace(node, **{path[0]: value})
    return dataclasses.replace(node, **{path[0]: _replace_at(getattr(node, path[0]), path[1:], value)})


def _bumped(leaf: stats.Leaf, value):
    """A different value of the leaf's type: numbers grow, a leaf of rows gets one more row, a tuple one more item."""
    if isinstance(value, tuple):
        rows = [s.metric for s in leaf.series if s.metric.labels and not s.label_values]
        return value + (((f"x{len(value)}",) * len(rows[0].labels) + (3,),) if rows else (5,))
    return value + (0.5 if isinstance(value, float) else 7)


def _base() -> EngineStats:
    """A tree whose every leaf is a distinct non-zero value (the pool bigger than its free rBlocks)."""
    tree = EngineStats()
    for i, leaf in enumerate(_leaf_paths()):
        tree = _replace_at(tree, leaf.path, _bumped(leaf, stats.read(tree, leaf.path)) if i % 2 else
                           _bumped(leaf, _bumped(leaf, stats.read(tree, leaf.path))))
    return _replace_at(tree, ("scheduler", "pool_blocks"), 1000)


def _samples_of(text: str, name: str) -> dict[str, float]:
    return {k: v for k, v in parse(text).items() if k == name or k.startswith(name + "{")}


def test_the_engine_series_are_the_pinned_set():
    for tree in (None, _base()):  # unloaded (no labelled samples: label names from the pin) and loaded
        declared = _declared(_render(tree))
        assert declared.keys() == ENGINE_METRICS.keys()
        for name, (kind, labels, help_text) in declared.items():
            assert (kind, help_text) == ENGINE_METRICS[name][::2], name
            assert tree is None or labels == ENGINE_METRICS[name][1], name


def test_every_metric_the_tree_declares_is_rendered():
    rendered = _declared(_render(_base()))
    for export in stats.exports():
        m = export.metric
        assert rendered[m.name] == (m.kind, m.labels, m.help), m.name
        assert _samples_of(_render(_base()), m.name), f"{m.name} has no sample"


def test_every_leaf_reaches_metrics_or_says_why_not():
    """Each leaf, changed alone, changes the samples of the metrics it names (its own series, or the derived ones it
    feeds); the leaves that reach no metric are the pinned UNEXPORTED ones."""
    base = _base()
    before = _render(base)
    unexported = set()
    for leaf in _leaf_paths():
        dotted = ".".join(leaf.path)
        assert leaf.kind in stats.KINDS, dotted
        if leaf.unexported is not None:
            assert leaf.unexported and not leaf.series and not leaf.feeds, dotted
            unexported.add(dotted)
            continue
        names = [s.metric.name for s in leaf.series] + list(leaf.feeds)
        assert names, f"{dotted} names no metric"
        after = _render(_replace_at(base, leaf.path, _bumped(leaf, stats.read(base, leaf.path))))
        for series in leaf.series:
            name = series.metric.name
            if series.label_values:
                key = name + "{" + ",".join(f'{n}="{v}"' for n, v in zip(series.metric.labels,
                                                                         series.label_values)) + "}"
                assert parse(after)[key] != parse(before)[key], f"{dotted} does not reach {key}"
            else:
                assert _samples_of(after, name) != _samples_of(before, name), f"{dotted} does not reach {name}"
        for name in leaf.feeds:
            assert _samples_of(after, name) != _samples_of(before, name), f"{dotted} does not feed {name}"
    assert unexported == UNEXPORTED


def test_a_leaf_without_metric_metadata_fails_the_walk_and_the_exporter():
    @dataclasses.dataclass(frozen=True)
    class Grown(stats.SchedulerStats):
        new_counter_total: int = 0

    @dataclasses.dataclass(frozen=True)
    class GrownEngine(EngineStats):
        scheduler: stats.SchedulerStats = dataclasses.field(default_factory=Grown)

    with pytest.raises(TypeError, match="scheduler.new_counter_total says nothing of /metrics"):
        stats.exports(GrownEngine)


def test_derived_metrics_are_computed_from_the_tree():
    tree = _replace_at(_replace_at(EngineStats(), ("scheduler", "pool_blocks_free"), 250),
                       ("scheduler", "pool_blocks"), 1000)
    tree = _replace_at(_replace_at(tree, ("executor", "kv_block_bytes"), 64),
                       ("scheduler", "lending", "borrowed_by_instance"), (3, 0, 4))
    got = parse(_render(tree))
    assert got["jaxllm_kv_pool_usage_ratio"] == 0.75
    assert got['jaxllm_kv_tier_used_blocks{tier="device"}'] == 750
    assert got['jaxllm_kv_tier_used_bytes{tier="device"}'] == 750 * 64
    assert got["jaxllm_kv_borrowed_blocks"] == 7
