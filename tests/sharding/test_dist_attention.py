"""DistAttention over 2, 4 and 8 CPU devices equals single-device attention over the unsplit KV.

The multi-device cases need XLA_FLAGS set before jax starts, so one subprocess runs this file as a
script (all cases, one jax start-up) and the test checks it finished every case. Decode: each case
spreads every sequence's KV over the instances at random cut points (awkward lengths, parts in any
order over instances, some instances holding nothing of a sequence) and stores each part in shuffled
local rBlocks whose unused rows hold NaN. Prefill: every rBlock of every sequence goes to a random
instance (runs of random length, several runs of one sequence on one instance), the part rows come
from `prefill_parts`, and chunks after cached prefixes are compared (kernel in interpret mode, and the
jnp reference on 2 devices) with the unsplit reference, residuals included. bf16 and int8 pools; one
float32 decode case is compared with a float64 NumPy oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

DEVICES = (2, 4, 8)
KV = ("bf16", "int8")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.slow
@pytest.mark.xdist_group("dist_attention")
def test_dist_attention_on_2_4_8_host_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    print(run.stdout[-4000:], run.stderr[-4000:])
    assert run.returncode == 0, run.stderr[-4000:]
    done = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("ok ")}
    want = {f"{n}x{kv}-{op}" for n in DEVICES for kv in KV for op in ("decode", "prefill")}
    want |= {f"2x{kv}-{op}_ref" for kv in KV for op in ("decode", "prefill")} | {"oracle", "several_runs"}
    assert want <= done, sorted(want - done)


def test_errors_name_the_shapes():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from sharding.dist_attention import dist_decode_attention, dist_prefill_attention

    mesh = Mesh(np.array(jax.devices()[:1]), ("instance",))
    q = jnp.zeros((2, 4, 64), jnp.float32)
    pools = jnp.zeros((1, 3, 2, 16, 64), jnp.float32)
    tables, lens = jnp.zeros((1, 2, 1), jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="mesh has no axis 'data'"):
        dist_decode_attention(q, pools, pools, tables, lens, mesh=mesh, axis="data")
    with pytest.raises(ValueError, match="pools stack 2 instances; the mesh axis 'instance' has 1"):
        dist_decode_attention(q, jnp.concatenate([pools] * 2), jnp.concatenate([pools] * 2), tables, lens, mesh=mesh)
    with pytest.raises(ValueError, match=r"lens \(1, 3\) must be \[instances, num_seqs\] = \(1, 2\)"):
        dist_decode_attention(q, pools, pools, tables, jnp.zeros((1, 3), jnp.int32), mesh=mesh)
    with pytest.raises(ValueError, match="int8 pools need k_scales and v_scales"):
        dist_decode_attention(q, pools.astype(jnp.int8), pools.astype(jnp.int8), tables, lens, mesh=mesh)
    rows = (tables, lens, lens, jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 4), jnp.int32))  # R = 2 rows
    with pytest.raises(ValueError, match=r"query_starts \(1, 3\) must be kv_lens' shape \(1, 2\)"):
        dist_prefill_attention(q, pools, pools, tables, lens, jnp.zeros((1, 3), jnp.int32), *rows[3:], mesh=mesh)
    with pytest.raises(ValueError, match=r"cu_q_lens \(1, 2\) must be \[instances, rows \+ 1\] = \(1, 3\)"):
        dist_prefill_attention(q, pools, pools, *rows[:3], jnp.zeros((1, 2), jnp.int32), rows[4], mesh=mesh)
    with pytest.raises(ValueError, match=r"token_index \(4,\) must be \[instances=1, local tokens\]"):
        dist_prefill_attention(q, pools, pools, *rows[:4], jnp.zeros((4,), jnp.int32), mesh=mesh)
    # Rows without keys (lens 0): zeros, no NaN.
    out = dist_prefill_attention(q, pools, pools, *rows, mesh=mesh, reference=True)
    assert out.shape == q.shape and not np.asarray(out).any()  # no row has a key: zeros


# ----- the subprocess -----

LENS = (1, 15, 16, 17, 53)  # 1, block-1, block, block+1, a non-multiple over several rBlocks
HEADS = (4, 2, 64)  # q heads, kv heads, head_dim (the kernels take 64 or 128)
BLOCK = 16


def _dense(rng, kv):
    """Per sequence K and V [Hkv, L, D] as stored (float32 values, or int8 with scales [Hkv, L])."""
    _, hkv, d = HEADS
    out = []
    for n in LENS:
        if kv == "int8":
            k, v = (rng.integers(-127, 128, (hkv, n, d)).astype(np.int8) for _ in range(2))
            ks, vs = (rng.uniform(0.002, 0.02, (hkv, n)).astype(np.float32) for _ in range(2))
            out.append((k, v, ks, vs))
        else:
            out.append((rng.standard_normal((hkv, n, d)).astype(np.float32),
                        rng.standard_normal((hkv, n, d)).astype(np.float32), None, None))
    return out


def _pool(rng, pieces, dtype, poison):
    """Store each piece ([Hkv, n, D] arrays and scales) from row 0 of shuffled rBlocks of one pool.

    Returns (k, v, k_scale, v_scale, table [len(pieces), width]); rows no piece uses hold `poison`
    (NaN values, or NaN scales for int8)."""
    _, hkv, d = HEADS
    counts = [-(-p[0].shape[1] // BLOCK) for p in pieces]
    width = max(1, max(counts))
    num_blocks = sum(counts) + 2
    ids = rng.permutation(num_blocks)
    quantized = dtype == np.int8
    k = np.zeros((num_blocks, hkv, BLOCK, d), np.float32)
    v = np.zeros_like(k)
    ks = np.full((num_blocks, hkv, BLOCK), poison if quantized else 1.0, np.float32)
    vs = ks.copy()
    if not quantized:
        k[:], v[:] = poison, poison
    table = np.zeros((len(pieces), width), np.int32)
    used = 0
    for s, (pk, pv, pks, pvs) in enumerate(pieces):
        for j in range(counts[s]):
            b = ids[used]
            used += 1
            table[s, j] = b
            rows = slice(j * BLOCK, min((j + 1) * BLOCK, pk.shape[1]))
            n = rows.stop - rows.start
            k[b, :, :n], v[b, :, :n] = pk[:, rows], pv[:, rows]
            if quantized:
                ks[b, :, :n], vs[b, :, :n] = pks[:, rows], pvs[:, rows]
    if quantized:
        return k.astype(np.int8), v.astype(np.int8), ks, vs, table
    return k, v, None, None, table


def _split(rng, dense, instances, dtype):
    """Cut every sequence at random points, parts to instances in a random order; sequence 0 lies whole
    on one instance. Returns stacked pools, scales, tables [I, S, W], starts and lens [I, S]."""
    starts = np.zeros((instances, len(LENS)), np.int32)
    lens = np.zeros_like(starts)
    for s, n in enumerate(LENS):
        cuts = np.sort(rng.integers(0, n + 1, instances - 1)) if s else np.full(instances - 1, n)
        bounds = np.concatenate([[0], cuts, [n]])
        owner = rng.permutation(instances)
        for part in range(instances):
            starts[owner[part], s], lens[owner[part], s] = bounds[part], bounds[part + 1] - bounds[part]
    pools = []
    for i in range(instances):
        pieces = [tuple(None if x is None else (x[..., starts[i, s]:starts[i, s] + lens[i, s], :] if x.ndim == 3 else
                                                x[..., starts[i, s]:starts[i, s] + lens[i, s]]) for x in dense[s])
                  for s in range(len(LENS))]
        pools.append(_pool(rng, pieces, dtype, np.nan))
    num_blocks = max(p[0].shape[0] for p in pools)
    width = max(p[4].shape[1] for p in pools)

    def stack(j, fill):
        arrays = [p[j] for p in pools]
        if arrays[0] is None:
            return None
        pad = lambda a, n: np.concatenate([a, np.full((n - a.shape[0],) + a.shape[1:], fill, a.dtype)])
        return np.stack([pad(a, num_blocks) for a in arrays])

    tables = np.stack([np.pad(p[4], ((0, 0), (0, width - p[4].shape[1]))) for p in pools])
    return stack(0, 0), stack(1, 0), stack(2, 1.0), stack(3, 1.0), tables, starts, lens


def _placed(rng, dense, instances, dtype):
    """Every rBlock of every sequence on a random instance (the previous one half the time: runs), at a
    shuffled local rBlock. Returns stacked pools, scales (NaN-poisoned unused rows) and per sequence its
    table of (instance, local block) pairs."""
    where = [[] for _ in range(instances)]  # per instance: (sequence, table entry)
    tables = []
    for s, n in enumerate(LENS):
        table = []
        for e in range(-(-n // BLOCK)):
            instance = table[-1][0] if table and rng.random() < 0.5 else int(rng.integers(instances))
            if e == 2 and table[0][0] != table[1][0]:
                instance = table[0][0]  # two runs of one sequence on one instance, apart
            table.append((instance, len(where[instance])))
            where[instance].append((s, e))
        tables.append(table)
    pools = []
    for i in range(instances):
        pieces = [tuple(None if x is None else x[..., e * BLOCK:(e + 1) * BLOCK, :] if x.ndim == 3 else
                        x[..., e * BLOCK:(e + 1) * BLOCK] for x in dense[s]) for s, e in where[i]]
        if not pieces:  # an instance holding nothing: a pool of poison only
            pieces = [tuple(None if x is None else x[..., :0, :] if x.ndim == 3 else x[..., :0] for x in dense[0])]
        k, v, ks, vs, table = _pool(rng, pieces, dtype, np.nan)  # piece j in local rBlock table[j, 0]
        pools.append((k, v, ks, vs))
        for j, (s, e) in enumerate(where[i]):
            tables[s][e] = (i, int(table[j, 0]))
    num_blocks = max(p[0].shape[0] for p in pools)

    def stack(j, fill):
        if pools[0][j] is None:
            return None
        pad = lambda a: np.concatenate([a, np.full((num_blocks - a.shape[0],) + a.shape[1:], fill, a.dtype)])
        return np.stack([pad(p[j]) for p in pools])

    return stack(0, 0), stack(1, 0), stack(2, 1.0), stack(3, 1.0), tables


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _oracle_decode(q, dense):
    """float64 NumPy decode attention over the dense KV: [S, Hq, D]."""
    hq, hkv, d = HEADS
    out = np.zeros(q.shape, np.float64)
    for s, (k, v, _, _) in enumerate(dense):
        qs = q[s].astype(np.float64).reshape(hkv, hq // hkv, d)
        scores = np.einsum("kgd,kld->kgl", qs, k.astype(np.float64)) / np.sqrt(d)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[s] = (np.einsum("kgl,kld->kgd", p, v.astype(np.float64)) / p.sum(-1)[..., None]).reshape(hq, d)
    return out


def _main():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from pallas_kernels.ragged_decode import ragged_decode_reference
    from pallas_kernels.ragged_prefill import ragged_prefill_reference
    from pallas_kernels.ragged_prefill import PrefillBlockSizes
    from sharding.dist_attention import dist_decode_attention, dist_prefill_attention
    from sharding.prefill_parts import prefill_parts

    assert len(jax.devices()) == 8, jax.devices()
    # Jitted, each shard_map compiles once; called eagerly it runs op by op (seconds a call on the CPU).
    static = ("mesh", "axis", "reference", "return_residuals", "sm_scale", "block_sizes", "interpret")
    dist_decode = jax.jit(dist_decode_attention, static_argnames=static)
    dist_prefill = jax.jit(dist_prefill_attention, static_argnames=static)
    t0 = time.time()
    rng = np.random.default_rng(int(os.environ.get("JAXLLM_TEST_SEED", "0")))
    hq, _, d = HEADS
    tol = {"bf16": 2e-2, "int8": 2e-2, "f32": 1e-5}
    several_runs = 0  # cases where an instance holds two or more runs of one sequence
    for instances in DEVICES:
        mesh = Mesh(np.array(jax.devices()[:instances]), ("instance",))
        for kv in KV + (("f32",) if instances == 4 else ()):
            dense = _dense(rng, kv)
            pool_dtype = {"bf16": jnp.bfloat16, "int8": jnp.int8, "f32": jnp.float32}[kv]
            q_dtype = jnp.float32 if kv == "f32" else jnp.bfloat16
            k, v, ks, vs, table = _pool(rng, dense, np.int8 if kv == "int8" else np.float32, 0.0)
            kw = {} if ks is None else dict(k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
            unsplit = (jnp.asarray(k, pool_dtype), jnp.asarray(v, pool_dtype), jnp.asarray(table))
            sk, sv, sks, svs, tables, starts, lens = _split(rng, dense, instances, np.int8 if kv == "int8" else None)
            skw = {} if sks is None else dict(k_scales=jnp.asarray(sks), v_scales=jnp.asarray(svs))
            split = (jnp.asarray(sk, pool_dtype), jnp.asarray(sv, pool_dtype), jnp.asarray(tables))
            kv_lens = jnp.asarray(LENS, jnp.int32)
            assert (lens.sum(0) == np.asarray(LENS)).all() and (lens == 0).any()

            q = jnp.asarray(rng.standard_normal((len(LENS), hq, d)), q_dtype)
            want = ragged_decode_reference(q, *unsplit, kv_lens, **kw).astype(jnp.float32)
            if kv == "f32":
                oracle = _oracle_decode(np.asarray(q), dense)
                got = dist_decode(q, *split, jnp.asarray(lens), mesh=mesh, reference=True, **skw)
                errs = (_rel_err(got, oracle), _rel_err(want, oracle))
                assert max(errs) < tol["f32"], errs
                print(f"ok oracle {errs}", flush=True)
                continue
            # The jnp path once (it is the kernel's stand-in, not what runs): the kernel at every size.
            for op, reference in (("decode", False),) + ((("decode_ref", True),) if instances == 2 else ()):
                got, (m, l) = dist_decode(q, *split, jnp.asarray(lens), mesh=mesh, reference=reference,
                                          return_residuals=True, **skw)
                _, (want_m, want_l) = ragged_decode_reference(q, *unsplit, kv_lens, return_residuals=True, **kw)
                err = _rel_err(got.astype(jnp.float32), want)
                assert got.dtype == q.dtype and err < tol[kv], (instances, kv, op, err)
                # The merged statistics are the unsplit ones: the result can merge again, exactly.
                assert np.allclose(m, want_m, rtol=1e-2, atol=1e-2), (instances, kv, op)
                assert np.allclose(l, want_l, rtol=5e-2), (instances, kv, op)
                print(f"ok {instances}x{kv}-{op} {err:.2e} {time.time() - t0:.1f}s", flush=True)

            q_lens = np.array([rng.integers(1, min(n, 20) + 1) for n in LENS])  # chunks after a cached part
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
            tokens = int(q_lens.sum()) + 3  # padding tokens past the last sequence
            qp = jnp.asarray(rng.standard_normal((tokens, hq, d)), q_dtype)
            want, (want_m, want_l) = ragged_prefill_reference(qp, *unsplit, kv_lens, cu, return_residuals=True, **kw)
            pk, pv, pks, pvs, placements = _placed(rng, dense, instances, np.int8 if kv == "int8" else None)
            parts = prefill_parts(placements, LENS, q_lens, block_size=BLOCK, instances=instances)
            several_runs += any(np.bincount(row[row >= 0], minlength=1).max() > 1 for row in parts.seq)
            pkw = {} if pks is None else dict(k_scales=jnp.asarray(pks), v_scales=jnp.asarray(pvs))
            placed = (jnp.asarray(pk, pool_dtype), jnp.asarray(pv, pool_dtype))
            for op, reference in (("prefill", False),) + ((("prefill_ref", True),) if instances == 2 else ()):
                got, (m, l) = dist_prefill(
                    qp, *placed, *map(jnp.asarray, parts.device_args()), mesh=mesh, reference=reference,
                    return_residuals=True, block_sizes=PrefillBlockSizes(block_q=16, block_k=16), **pkw)
                err = _rel_err(got.astype(jnp.float32), want.astype(jnp.float32))
                assert got.dtype == q_dtype and err < tol[kv], (instances, kv, op, err)
                assert not np.asarray(got[-3:]).any() and np.all(np.asarray(m[-3:]) == -np.inf), (instances, kv, op)
                assert np.allclose(m, want_m, rtol=1e-2, atol=1e-2), (instances, kv, op)
                assert np.allclose(l, want_l, rtol=5e-2), (instances, kv, op)
                print(f"ok {instances}x{kv}-{op} {err:.2e} {time.time() - t0:.1f}s", flush=True)
    assert several_runs, "no case put two runs of one sequence on one instance"
    print(f"ok several_runs {several_runs}", flush=True)


if __name__ == "__main__":
    _main()
