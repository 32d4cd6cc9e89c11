"""DistAttention as the executor runs it, on 2, 4 and 8 CPU host devices, equals one device's attention over the
unsplit KV.

Each case is a StepPlan built by hand (random q/k/v instead of a model's projection): sequences of awkward lengths
(1, block - 1, block, block + 1, several rBlocks) with random homes, every rBlock of every sequence on a random
instance (runs of random length, parts in any order, some instances holding nothing of a sequence, two runs of
one sequence on one instance, a sequence with nothing at home), at shuffled local rBlocks; every pool row no
cached token uses holds NaN (int8 pools: NaN scales), so a read outside a part shows. `InputLayout.build`
turns the plan into the stacked per-instance inputs and DistParts, and the step runs `dispatch.paged_attention`
with `Kernels.distributed = DistAttention()` per instance inside a shard_map over `instance`, as
jaxllm.executor.programs does. Every real token's output, and the K/V the step wrote, are compared with
`paged_attention` over one pool holding the same KV (global-equivalent tables, the jnp reference); the pools
are otherwise unchanged and padding tokens come out 0. Decode, and prefill chunks after cached prefixes (half
the cases feed qkv as the skinny matmul's float32 split-K partials, as steps of up to 64 tokens do on the GPU);
the Pallas kernels in interpret mode at every instance count, the jnp reference on 2 and 8; bf16 and int8
pools; one float32 decode case against a float64 NumPy oracle. The exact merge over the axis
(`SpreadOverAxis`) is checked against `merge_partials` over a leading axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.contract import StepKind, StepPlan
from jaxllm.executor.inputs import InputLayout, token_rows
from jaxllm.executor.step import StepInputs
from jaxllm.tuner.buckets import Buckets
from pallas_kernels import dispatch
from pallas_kernels.ragged_prefill import PrefillBlockSizes
from pallas_kernels.residuals import merge_partials
from sharding.dist_attention import DistAttention, DistParts, SpreadOverAxis
from sharding.mesh import INSTANCE
from tests.devices import needs_host_devices

pytestmark = [needs_host_devices, pytest.mark.slow, pytest.mark.xdist_group("dist_attention")]

BLOCK = 16
LENS = (1, 15, 16, 17, 53)  # 1, block-1, block, block+1, a non-multiple over several rBlocks (the longest)
HQ, HKV, D = 4, 2, 64  # the kernels take head_dim 64 or 128
GROUP = HQ // HKV
ENTRIES = sum(-(-n // BLOCK) for n in LENS)
BLOCKS_PER_INSTANCE = ENTRIES + 1  # room for every rBlock on one instance, and a spare: one pool shape per mesh
TABLE_WIDTH = -(-max(LENS) // BLOCK) + 1  # the executor's width: a padding column past the longest table
MAX_CHUNK = 20  # prefill: a chunk of at most this many tokens ends each sequence
SEED = 20261202
TRITON = dispatch.Kernels(decode_attention="triton", prefill_attention="triton", rope_kv_write="pallas",
                          prefill_block_sizes=PrefillBlockSizes(block_q=16, block_k=16), interpret=True)
# Relative to the largest output: bf16 outputs (and bf16 / int8 KV on both sides); float32 against float64.
TOL = {"bf16": 2e-2, "int8": 2e-2, "f32": 1e-5}
POOL_DTYPE = {"bf16": jnp.bfloat16, "int8": jnp.int8, "f32": jnp.float32}
SPLIT_K = 2  # bf16 decode and int8 prefill cases feed qkv as this many float32 partials (matmul_unreduced's)


@dataclasses.dataclass(frozen=True)
class _Case:
    """One step: the plan, its stacked per-instance inputs (StepInputs with DistParts), the split pools and the
    reference (unsplit) pool.

    split: (k, v, k_scale, v_scale) [I * nb, Hkv, BLOCK, D] in global ids (scales None for float pools), as
    generated (float32 or int8 values, cast to the pool dtype when run). ref: the same KV in one pool, each
    sequence's rBlocks consecutive (ref_tables [S, W]); ref_slots [N] the plan tokens' slots there.
    qkv [N, Hkv, G + 2, D] (or [P, N, ...] float32 partials), cos, sin [N, D/2]: the plan tokens'; stacked_*: the
    same per instance, [I, T, ...] ([I, P, T, ...]), padding tokens holding garbage. cached: per sequence the
    values of its cached positions as stored (K, V [c, Hkv, D], and int8 scales [c, Hkv]).
    """

    plan: StepPlan
    inputs: StepInputs
    split: tuple
    ref: tuple
    ref_tables: np.ndarray
    ref_slots: np.ndarray
    qkv: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    stacked_qkv: np.ndarray
    stacked_cos: np.ndarray
    stacked_sin: np.ndarray
    cached: list


def _rope(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [tokens, D/2] float32 of Llama's RoPE (base 10000) at these positions."""
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D)
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _place(rng, instances: int, n: int, longest: bool, away: int | None) -> list[int]:
    """The instance of each of a sequence's rBlocks: the previous one's half the time (runs), never `away` (its
    home, for a sequence with nothing at home); the longest sequence starts on two instances and comes back to
    the first (two runs of it on one instance)."""
    out = []
    for e in range(-(-n // BLOCK)):
        instance = out[-1] if out and rng.random() < 0.5 else int(rng.integers(instances))
        if instance == away:
            instance = (away + 1 + int(rng.integers(instances - 1))) % instances
        if longest and e == 1 and instance == out[0]:
            instance = (out[0] + 1 + int(rng.integers(instances - 1))) % instances
        if longest and e == 2:
            instance = out[0]
        out.append(instance)
    return out


def _tables(rng, instances: int, lens: np.ndarray, homes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(global tables [S, W] at shuffled local rBlocks, the reference pool's tables [S, W]: sequence s in rBlocks
    ref_first[s] ...). Padding columns of the global tables point anywhere: they must be ignored."""
    nb, width = BLOCKS_PER_INSTANCE, TABLE_WIDTH - 1
    free = [list(rng.permutation(nb)) for _ in range(instances)]
    tables = rng.integers(instances * nb, size=(len(lens), width)).astype(np.int32)
    ref_tables = np.zeros_like(tables)
    first = 0
    for s, n in enumerate(lens):
        where = _place(rng, instances, int(n), n == max(LENS), homes[s] if n == BLOCK + 1 else None)
        tables[s, :len(where)] = [i * nb + free[i].pop() for i in where]
        ref_tables[s, :len(where)] = first + np.arange(len(where))
        first += len(where)
    return tables, ref_tables


def _pools(rng, kv: str, instances: int, lens, cached_lens, tables, ref_tables):
    """(split pools, reference pool, per sequence its cached values): each sequence's first cached_lens[s]
    positions hold random K/V (int8 with scales) in both layouts; every other row of the split pools holds NaN
    (int8: NaN scales). Pools are (k, v, k_scale, v_scale) NumPy arrays, scales None for float pools."""
    shape = (instances * BLOCKS_PER_INSTANCE, HKV, BLOCK, D)
    ref_shape = (ENTRIES,) + shape[1:]
    if kv == "int8":
        split = [rng.integers(-127, 128, shape).astype(np.int8) for _ in range(2)]
        split += [np.full(shape[:3], np.nan, np.float32) for _ in range(2)]
        ref = [np.zeros(ref_shape, np.int8) for _ in range(2)] + [np.ones(ref_shape[:3], np.float32) for _ in range(2)]
    else:
        split = [np.full(shape, np.nan, np.float32) for _ in range(2)] + [None, None]
        ref = [np.zeros(ref_shape, np.float32) for _ in range(2)] + [None, None]
    cached = []
    for s, c in enumerate(cached_lens):
        if kv == "int8":
            values = [rng.integers(-127, 128, (c, HKV, D)).astype(np.int8) for _ in range(2)]
            values += [rng.uniform(0.002, 0.02, (c, HKV)).astype(np.float32) for _ in range(2)]
        else:
            values = [rng.standard_normal((c, HKV, D)).astype(np.float32) for _ in range(2)]
        cached.append(values)
        p = np.arange(c)
        for j, value in enumerate(values):
            split[j][tables[s, p // BLOCK], :, p % BLOCK] = value
            ref[j][ref_tables[s, p // BLOCK], :, p % BLOCK] = value
    return tuple(split), tuple(ref), cached


def _make_case(rng, instances: int, kv: str, decode: bool, *, split_k: int = 0) -> _Case:
    """A step over LENS (kv_lens after it) with random homes: decode, or chunks of 1 .. MAX_CHUNK tokens ending
    each sequence (after a cached prefix, or a whole prompt); split_k: qkv as that many float32 partials."""
    n_seqs = len(LENS)
    lens = rng.permutation(LENS)
    homes = np.sort(rng.integers(instances, size=n_seqs)).astype(np.int32)
    q_lens = np.ones(n_seqs, np.int64) if decode else np.array([rng.integers(1, min(n, MAX_CHUNK) + 1) for n in lens])
    tables, ref_tables = _tables(rng, instances, lens, homes)
    split, ref, cached = _pools(rng, kv, instances, lens, lens - q_lens, tables, ref_tables)
    positions = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens)]).astype(np.int32)
    seq = np.repeat(np.arange(n_seqs), q_lens)
    slot = lambda t: t[seq, positions // BLOCK] * BLOCK + positions % BLOCK  # noqa: E731
    zeros = np.zeros(n_seqs)
    plan = StepPlan(
        seq_ids=np.arange(n_seqs), token_ids=np.zeros(len(positions), np.int32), positions=positions,
        slot_mapping=slot(tables).astype(np.int32), cu_q_lens=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        kv_lens=lens.astype(np.int32), block_tables=tables, sample=np.ones(n_seqs, bool),
        temperature=zeros.astype(np.float32), top_k=zeros.astype(np.int32), top_p=np.ones(n_seqs, np.float32),
        seed=zeros.astype(np.int32), instances=homes)
    batch = _layout(instances).build(plan)
    assert batch.borrowed and batch.inputs.parts is not None
    inputs = batch.inputs
    t_pad = inputs.num_tokens
    rows = token_rows(plan, instances, t_pad)
    # The stacked positions say which rows are real; the RoPE tables come from them, as the model's do.
    assert np.array_equal(inputs.positions.reshape(-1)[rows], positions)
    stacked_cos, stacked_sin = (x.reshape(instances, t_pad, -1) for x in _rope(inputs.positions.reshape(-1)))
    lead = (split_k,) if split_k else ()
    flat_qkv = rng.standard_normal(lead + (instances * t_pad, HKV, GROUP + 2, D)).astype(np.float32)
    stacked_qkv = flat_qkv.reshape(lead + (instances, t_pad) + flat_qkv.shape[-3:])
    if split_k:
        stacked_qkv = np.moveaxis(stacked_qkv, 0, 1)  # [I, P, T, ...]: each instance's partials
    return _Case(plan, inputs, split, ref, ref_tables, slot(ref_tables), flat_qkv[..., rows, :, :, :],
                 *_rope(positions), stacked_qkv, stacked_cos, stacked_sin, cached)


def _layout(instances: int) -> InputLayout:
    buckets = Buckets(max_seqs=8, max_tokens_per_step=4096, table_width=TABLE_WIDTH, min_tokens=8)
    return InputLayout(instances=instances, blocks_per_instance=BLOCKS_PER_INSTANCE, block_size=BLOCK, buckets=buckets)


def _layout_kinds(plan: StepPlan, instances: int) -> set[str]:
    """The awkward layouts a plan has (what the cases promise to cover)."""
    kinds = set()
    for s, n in enumerate(plan.kv_lens):
        holders = [int(g) // BLOCKS_PER_INSTANCE for g in plan.block_tables[s, :-(-int(n) // BLOCK)]]
        runs = [i for e, i in enumerate(holders) if e == 0 or holders[e - 1] != i]
        if len(runs) > len(set(runs)):
            kinds.add("several runs on one instance")
        if plan.instances[s] not in holders:
            kinds.add("nothing at home")
        if len(set(holders)) < instances:
            kinds.add("an instance without a part")
    if len(set(plan.instances.tolist())) < instances:
        kinds.add("an instance without a home sequence")
    return kinds


@functools.cache
def _dist_step(instances: int, decode: bool, dtype, kernels: dispatch.Kernels):
    """The jitted step: per instance, paged_attention with the DistAttention hook, as the executor's programs run
    a layer's attention. Inputs and outputs stacked [I, ...] (pools: [I * nb, ...])."""
    mesh = Mesh(np.array(jax.devices()[:instances]), (INSTANCE,))
    kernels = dataclasses.replace(kernels, distributed=DistAttention())

    def local(qkv, cos, sin, k, v, k_scale, v_scale, inputs):
        qkv, cos, sin, inputs = jax.tree.map(lambda x: x[0], (qkv, cos, sin, inputs))
        batch = dispatch.AttentionBatch(inputs.block_tables, inputs.kv_lens, inputs.cu_q_lens, inputs.slot_mapping,
                                        inputs.parts, single_query=decode)
        out, *pools = dispatch.paged_attention(k, v, k_scale, v_scale, qkv, cos, sin, batch, num_q_heads=HQ,
                                               dtype=dtype, kernels=kernels)
        return out[None], *pools

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(INSTANCE), out_specs=P(INSTANCE),
                                 axis_names={INSTANCE}, check_vma=False))


@functools.cache
def _reference_step(decode: bool, dtype):
    """paged_attention on one device over one pool (the jnp reference)."""

    def step(qkv, cos, sin, k, v, k_scale, v_scale, tables, kv_lens, cu_q_lens, slots):
        batch = dispatch.AttentionBatch(tables, kv_lens, cu_q_lens, slots, single_query=decode)
        return dispatch.paged_attention(k, v, k_scale, v_scale, qkv, cos, sin, batch, num_q_heads=HQ, dtype=dtype)

    return jax.jit(step)


def _dtype(kv: str):
    return jnp.float32 if kv == "f32" else jnp.bfloat16


def _as_pools(pools, kv: str):
    k, v, ks, vs = pools
    return (jnp.asarray(k, POOL_DTYPE[kv]), jnp.asarray(v, POOL_DTYPE[kv]),
            None if ks is None else jnp.asarray(ks), None if vs is None else jnp.asarray(vs))


def _run_dist(case: _Case, instances: int, kv: str, kernels: dispatch.Kernels):
    """(out of each plan token [N, Hq, D] float32, the pools after the step as NumPy float32); the padding tokens'
    outputs are 0 (they have no keys)."""
    decode = case.plan.kind is StepKind.DECODE
    qkv = jnp.asarray(case.stacked_qkv, jnp.float32 if case.stacked_qkv.ndim == 6 else _dtype(kv))
    out, *pools = _dist_step(instances, decode, _dtype(kv), kernels)(
        qkv, case.stacked_cos, case.stacked_sin, *_as_pools(case.split, kv), case.inputs)
    rows = token_rows(case.plan, instances, case.inputs.num_tokens)
    assert out.dtype == _dtype(kv)
    out = np.asarray(out, np.float32).reshape(-1, HQ, D)
    padding = np.ones(len(out), bool)
    padding[rows] = False
    assert not out[padding].any(), "a padding token's output is not 0"
    return out[rows], [None if p is None else np.asarray(p, np.float32) for p in pools]


def _run_reference(case: _Case, kv: str):
    plan = case.plan
    qkv = jnp.asarray(case.qkv, jnp.float32 if case.qkv.ndim == 5 else _dtype(kv))
    out, *pools = _reference_step(plan.kind is StepKind.DECODE, _dtype(kv))(
        qkv, case.cos, case.sin, *_as_pools(case.ref, kv), case.ref_tables, plan.kv_lens, plan.cu_q_lens,
        case.ref_slots)
    return np.asarray(out, np.float32), [None if p is None else np.asarray(p, np.float32) for p in pools]


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _check_pools(case: _Case, kv: str, got_pools, want_pools, label):
    """The step wrote each new token's K/V (and int8 scales) at its slot as the reference did, and nothing else:
    every other row, poison included, is as before."""
    slots, ref_slots = case.plan.slot_mapping, case.ref_slots
    stored = [None if x is None else np.asarray(x, np.float32) for x in _as_pools(case.split, kv)]
    for name, got, before, want in zip(("k", "v", "k_scale", "v_scale"), got_pools, stored, want_pools):
        if before is None:
            assert got is None and want is None, (label, name)
            continue
        np.testing.assert_array_equal(got[slots // BLOCK, :, slots % BLOCK],
                                      want[ref_slots // BLOCK, :, ref_slots % BLOCK], err_msg=f"{label} {name}")
        untouched = np.ones(got.shape[0] * BLOCK, bool)
        untouched[slots] = False
        rows = lambda x: np.moveaxis(x, 2, 1).reshape((-1,) + x.shape[1:2] + x.shape[3:])  # noqa: E731
        np.testing.assert_array_equal(rows(got)[untouched], rows(before)[untouched],
                                      err_msg=f"{label} {name}: rows outside the step's slots changed")


def _check_case(case: _Case, instances: int, kv: str, kernels: dispatch.Kernels, label: str, want) -> float:
    want_out, want_pools = want
    got, pools = _run_dist(case, instances, kv, kernels)
    assert np.all(np.isfinite(got)), f"{label}: NaN/inf in the output (poison read)"
    err = _rel_err(got, want_out)
    assert err < TOL[kv], (label, err)
    _check_pools(case, kv, pools, want_pools, label)
    return err


CASES = [(i, kv, op) for i in (2, 4, 8) for kv in ("bf16", "int8") for op in ("decode", "prefill")]


@pytest.mark.parametrize("instances,kv,op", CASES, ids=[f"{i}x{kv}-{op}" for i, kv, op in CASES])
def test_dist_attention_equals_one_pool(instances, kv, op):
    rng = np.random.default_rng([SEED, CASES.index((instances, kv, op))])
    decode = op == "decode"
    # Steps of up to Kernels.fused_norm_max_tokens tokens get qkv as split-K partials under the GPU's kernels.
    partials = (kv == "bf16") == decode
    case = _make_case(rng, instances, kv, decode, split_k=SPLIT_K if partials else 0)
    assert _layout_kinds(case.plan, instances) >= {"several runs on one instance", "nothing at home",
                                                   "an instance without a part"}
    want = _run_reference(case, kv)
    assert np.all(np.isfinite(want[0]))
    errs = {"triton": _check_case(case, instances, kv, TRITON, f"{instances}x{kv}-{op} triton", want)}
    if instances in (2, 8):  # the jnp path (the kernels' stand-in off the GPU)
        errs["reference"] = _check_case(case, instances, kv, dispatch.REFERENCE, f"{instances}x{kv}-{op} ref", want)
    print(instances, kv, op, errs)


def _oracle(case: _Case) -> np.ndarray:
    """float64 NumPy: RoPE on each decode token's q and k, then attention over its sequence's cached K/V and its
    own. [S, Hq, D]."""
    out = np.zeros((case.plan.num_seqs, HQ, D))
    qkv = case.qkv.astype(np.float64)
    cos, sin = case.cos.astype(np.float64), case.sin.astype(np.float64)

    def rope(x, t):  # x [..., D]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([x1 * cos[t] - x2 * sin[t], x2 * cos[t] + x1 * sin[t]], axis=-1)

    for s, (k, v) in enumerate(case.cached):
        q = rope(qkv[s, :, :GROUP], s)  # [Hkv, G, D]
        keys = np.concatenate([k.astype(np.float64), rope(qkv[s, :, GROUP], s)[None]])  # [n, Hkv, D]
        values = np.concatenate([v.astype(np.float64), qkv[s, :, GROUP + 1][None]])
        scores = np.einsum("kgd,nkd->kgn", q, keys) / np.sqrt(D)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[s] = (np.einsum("kgn,nkd->kgd", p, values) / p.sum(-1)[..., None]).reshape(HQ, D)
    return out


def test_float32_decode_against_a_float64_oracle():
    instances = 4
    case = _make_case(np.random.default_rng([SEED, 32]), instances, "f32", decode=True)
    oracle = _oracle(case)
    want, _ = _run_reference(case, "f32")
    got, _ = _run_dist(case, instances, "f32", TRITON)
    errs = (_rel_err(got, oracle), _rel_err(want, oracle))
    assert max(errs) < TOL["f32"], errs
    print("oracle", errs)


@pytest.mark.parametrize("instances", (2, 4, 8))
def test_spread_over_axis_merges_as_merge_partials(instances):
    """Every member holds a partial of every row; each gets its own rows merged, as merge_partials merges the
    members' partials stacked on a leading axis. Empty parts (max -inf, sum 0, NaN out) weigh nothing; rows
    empty everywhere come out 0, -inf, 0."""
    rng = np.random.default_rng([SEED, 7, instances])
    rows, heads = 3, 2
    shape = (instances, instances * rows, heads)  # [member, gathered row, head]
    outs = rng.standard_normal(shape + (D,)).astype(np.float32)
    row_max = (rng.standard_normal(shape) * 4).astype(np.float32)
    row_sum = rng.uniform(0.5, 20.0, shape).astype(np.float32)
    empty = rng.random(shape) < 0.4
    empty[:, 1] = True  # a row no member has a key of
    empty[np.arange(instances), 2] = np.arange(instances)[:, None] != 0  # a row only member 0 has keys of
    outs[empty], row_max[empty], row_sum[empty] = np.nan, -np.inf, 0.0
    mesh = Mesh(np.array(jax.devices()[:instances]), (INSTANCE,))

    def local(o, m, s):
        out, mx, sm = merge_partials(o[0], m[0], s[0], parts=SpreadOverAxis(INSTANCE))
        return out[None], mx[None], sm[None]

    spread = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(INSTANCE), out_specs=P(INSTANCE),
                                   axis_names={INSTANCE}, check_vma=False))
    got = [np.asarray(x).reshape((instances * rows,) + x.shape[2:]) for x in spread(outs, row_max, row_sum)]
    want = [np.asarray(x) for x in merge_partials(jnp.asarray(outs), jnp.asarray(row_max), jnp.asarray(row_sum))]
    for name, g, w in zip(("out", "row_max", "row_sum"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.all(np.isfinite(got[0]))
    assert not got[0][1].any() and np.all(got[1][1] == -np.inf) and not got[2][1].any()
    np.testing.assert_allclose(got[0][2], outs[0, 2], rtol=1e-6)  # one live part: that part, as it is


def test_inert_borrowed_step_reads_and_writes_nothing():
    """Warm-up inputs of a borrowed step (InputLayout.inert): every row without keys comes out 0, and the pools,
    poison everywhere, are as before."""
    instances = 2
    layout = _layout(instances)
    rng = np.random.default_rng([SEED, 9])
    k = np.full((instances * BLOCKS_PER_INSTANCE, HKV, BLOCK, D), np.nan, np.float32)
    for decode, size in ((True, 4), (False, 8)):
        inputs = layout.inert(StepKind.DECODE if decode else StepKind.PREFILL, size, borrowed=True)
        t = inputs.num_tokens
        qkv = rng.standard_normal((instances, t, HKV, GROUP + 2, D)).astype(np.float32)
        cos, sin = _rope(np.zeros(instances * t, np.int32))
        out, k_out, v_out, _, _ = _dist_step(instances, decode, jnp.bfloat16, TRITON)(
            jnp.asarray(qkv, jnp.bfloat16), cos.reshape(instances, t, -1), sin.reshape(instances, t, -1),
            jnp.asarray(k, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), None, None, inputs)
        assert out.shape == (instances, t, HQ, D) and not np.asarray(out, np.float32).any(), decode
        assert np.all(np.isnan(np.asarray(k_out, np.float32))) and np.all(np.isnan(np.asarray(v_out, np.float32)))


@pytest.mark.parametrize("instances", (2, 4))
def test_a_scattered_borrowed_prefill_has_its_buckets_warm_up_shapes(instances):
    """A prefill chunk of a long sequence whose rBlocks alternate between the instances (a run per rBlock: a row per
    run, each with every query after it, gave several times the step's tokens in row queries) has exactly the
    inputs' shapes warm-up compiles and memory planning measures (InputLayout.inert): one program a bucket,
    whose working memory does not grow with the context or with how the rBlocks lie."""
    n, q_len = ENTRIES * BLOCK - 3, MAX_CHUNK
    entries = -(-n // BLOCK)
    base = _layout(instances)
    layout = dataclasses.replace(base, buckets=dataclasses.replace(base.buckets, table_width=entries))
    table = np.array([[(e % instances) * BLOCKS_PER_INSTANCE + e // instances for e in range(entries)]], np.int32)
    positions = np.arange(n - q_len, n, dtype=np.int32)
    plan = StepPlan(
        seq_ids=np.arange(1), token_ids=np.zeros(q_len, np.int32), positions=positions,
        slot_mapping=(table[0, positions // BLOCK] * BLOCK + positions % BLOCK).astype(np.int32),
        cu_q_lens=np.array([0, q_len], np.int32), kv_lens=np.array([n], np.int32), block_tables=table,
        sample=np.ones(1, bool), temperature=np.zeros(1, np.float32), top_k=np.zeros(1, np.int32),
        top_p=np.ones(1, np.float32), seed=np.zeros(1, np.int32), instances=np.zeros(1, np.int32))
    batch = layout.build(plan)
    assert batch.borrowed
    inert = layout.inert(StepKind.PREFILL, batch.size, borrowed=True)
    assert jax.tree.map(np.shape, batch.inputs) == jax.tree.map(np.shape, inert)
    parts = batch.inputs.parts
    # Instance 0 (home) and each lender: one past row of the sequence, holding the chunk's q_len queries.
    assert np.all((parts.row_lens > 0).sum(axis=1) == 1) and np.all(parts.row_cu_q_lens[:, -1] == q_len)
    assert parts.row_lens.sum() == n - q_len


def test_errors():
    """What the hook refuses, with the name of what is missing or wrong."""
    q = jnp.zeros((2, HKV, GROUP + 2, D), jnp.float32)
    pool = jnp.zeros((3, HKV, BLOCK, D), jnp.float32)
    cos = jnp.zeros((2, D // 2), jnp.float32)
    parts = DistParts(write_slots=jnp.full((2,), -1, jnp.int32), row_tables=jnp.zeros((2, 1), jnp.int32),
                      row_lens=jnp.zeros((2,), jnp.int32))
    batch = dispatch.AttentionBatch(jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32),
                                    jnp.arange(3, dtype=jnp.int32), jnp.zeros((2,), jnp.int32), parts, single_query=True)
    with pytest.raises(ValueError, match=r"needs Kernels\.distributed"):
        dispatch.paged_attention(pool, pool, None, None, q, cos, cos, batch, num_q_heads=HQ, dtype=jnp.float32,
                                 kernels=TRITON)
    with pytest.raises(ValueError, match="query_starts places prefill rows"):
        dispatch.ragged_attention(q, pool, pool, batch.block_tables, batch.kv_lens, batch.cu_q_lens, single_query=True,
                                  query_starts=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"outs \(3, 2, 64\) must be row_max/row_sum \(3, 4\) plus head_dim"):
        merge_partials(jnp.zeros((3, 2, D)), jnp.zeros((3, 4)), jnp.zeros((3, 4)), parts=SpreadOverAxis(INSTANCE))
    # The plans the layout turns into DistParts: grouped by home, homes on the mesh, tables within the width.
    case = _make_case(np.random.default_rng([SEED, 11]), 2, "bf16", decode=True)
    layout = _layout(2)
    homes = case.plan.instances
    with pytest.raises(ValueError, match="plan names instance 2; the engine has 2"):
        layout.build(dataclasses.replace(case.plan, instances=np.where(homes == homes.max(), 2, homes)))
    with pytest.raises(ValueError, match="rows must be grouped by instance"):
        layout.build(dataclasses.replace(case.plan, instances=np.array([1, 0, 0, 0, 0], np.int32)))
    wide = np.pad(case.plan.block_tables, ((0, 0), (0, 2)))
    with pytest.raises(ValueError, match=rf"exceed the executor's limits \(\d+ x {TABLE_WIDTH}\)"):
        layout.build(dataclasses.replace(case.plan, block_tables=wide))
