"""The Mosaic GPU ragged prefill kernel: GPU interpret mode on the CPU (jnp.dot in place of wgmma),
argument checks, its work list, and the wgmma kernel against the reference on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat
from pallas_kernels import ragged_prefill_mgpu as rpm
from pallas_kernels.ragged_prefill import ragged_prefill_reference
from pallas_kernels.testing import poisoned_ragged_batch
from tests.seeds import seed

_OUT_TOL = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3}
_GPU_OUT_TOL = {jnp.bfloat16: 4e-2, jnp.float16: 8e-3}
_interpretable = pytest.mark.skipif(compat.mgpu_interpret_params() is None,
                                    reason="this jax has no Mosaic GPU interpret mode")


def _batch(rng, *, num_kv_heads, group, padding=5, **kw):
    """Random ragged batch over a shuffled pool; unowned pool rows and padding query tokens are NaN."""
    return poisoned_ragged_batch(rng, num_kv_heads=num_kv_heads, num_q_heads=num_kv_heads * group, padding=padding,
                                 spare_blocks=2, **kw)


def _compare(args, out, residuals, tol):
    n = int(args[5][-1])
    ref_out, (ref_m, ref_l) = ragged_prefill_reference(*args, return_residuals=True)
    f32 = lambda x: np.asarray(x, np.float32)
    if residuals is not None:
        m, l = residuals
        np.testing.assert_allclose(f32(m[:n]), f32(ref_m[:n]), atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(f32(l[:n]), f32(ref_l[:n]), rtol=5e-3)
        assert np.all(np.isneginf(f32(m[n:]))) and np.all(f32(l[n:]) == 0)
    np.testing.assert_allclose(f32(out[:n]), f32(ref_out[:n]), atol=tol, rtol=0)
    assert np.all(f32(out[n:]) == 0)


@_interpretable
@pytest.mark.parametrize("case", [
    # fp16, GQA 2, rBlock 128 / block_kv 64: a 70-token prompt (2 sub-tiles, one partial), a decode row
    # after a 130-token prefix (crosses an rBlock), a 3-token chunk after 60; residuals.
    dict(q_lens=[70, 1, 3], cached=[0, 130, 60], block_size=128, block_kv=64, head_dim=64, num_kv_heads=1, group=2,
         dtype=jnp.float16, residuals=True, ctas=2),
    # bf16, MHA, head_dim 128, block_kv 128 = rBlock: a whole 64-row sub-tile after a 63-token prefix
    # (its rows start at packed token 0 of 200, a multiple of 8: Q and output by TMA straight to and
    # from the tiled buffer), and a 130-token prompt at packed token 66, whole sub-tiles at unaligned
    # rows (through plain SMEM). The case above has 79 tokens: every tile through plain SMEM.
    dict(q_lens=[64, 2, 130], cached=[63, 200, 0], padding=4, block_size=128, block_kv=128, head_dim=128,
         num_kv_heads=2, group=1, dtype=jnp.bfloat16, residuals=False, ctas=1),
], ids=["cluster2-fp16-gqa2-residuals", "single-bf16-d128"])
# Clustered (the first case): 2 CTAs per tile of 256 rows, a cluster sharing K/V copies on the GPU; here a grid
# axis, each CTA loading its own. The 70-token prompt leaves the second CTA of its tile without rows. Each case
# runs one CTA layout (interpret mode takes about a minute a case on a 2-core CI machine), between them both.
def test_interpret_matches_reference(case):
    case = dict(case)
    ctas = case.pop("ctas")
    residuals, block_kv = case.pop("residuals"), case.pop("block_kv")
    args = _batch(np.random.default_rng(seed(27380)), **case)
    try:
        res = rpm.ragged_prefill_mgpu(*args, return_residuals=residuals, interpret=True,
                                      config=rpm.MosaicPrefillConfig(block_kv=block_kv, cluster_ctas=ctas))
    except Exception:
        compat.reset_mgpu_interpret_state()
        raise
    out, extra = res if residuals else (res, None)
    _compare(args, out, extra, _OUT_TOL[case["dtype"]])


@pytest.mark.parametrize("tile_q", [128, 256], ids=["cta-tiles", "cluster2-tiles"])
def test_work_list_covers_every_token_once(tile_q):
    rng = np.random.default_rng(seed(27381))
    q_lens = np.array([1, 128, 129, 64, 300, 0, 65])
    kv_lens = q_lens + rng.integers(0, 400, len(q_lens))
    num_tokens = int(q_lens.sum()) + 70
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = rng.permutation(64 * len(q_lens)).reshape(len(q_lens), 64).astype(np.int32)
    work = np.asarray(rpm._work_list(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), num_tokens,
                                     tile_q, 128, True))
    seen = np.zeros(num_tokens, int)
    partial_per_owner = {}
    for seq, start, rows, pos0, kv_len, owner, nblk, rblock0 in work.T:
        assert rblock0 == tables[seq, 0]
        seen[start:start + rows] += 1
        for w in range(tile_q // 64):  # the compute warpgroups' sub-tiles, over the tile's CTAs
            sub = min(max(rows - 64 * w, 0), 64)
            if 0 < sub < 64:
                partial_per_owner[owner] = partial_per_owner.get(owner, 0) + 1
        if owner < len(q_lens) and rows:
            assert pos0 == kv_lens[seq] - q_lens[seq] + (start - cu[seq]) and kv_len == kv_lens[seq]
            assert nblk == -(-(pos0 + rows) // 128)
        else:
            assert nblk == 0
    assert np.all(seen == 1)
    assert all(v == 1 for v in partial_per_owner.values())
    assert np.all(np.diff(work[rpm._KV_BLOCKS]) <= 0)  # heaviest first


def _small(dtype=jnp.bfloat16, block_size=128, head_dim=64):
    return _batch(np.random.default_rng(0), q_lens=[3], cached=[2], block_size=block_size, head_dim=head_dim,
                  num_kv_heads=1, group=1, dtype=dtype)


def test_rejects_block_size_not_multiple_of_block_kv():
    with pytest.raises(ValueError, match="multiple of block_kv 128"):
        rpm.ragged_prefill_mgpu(*_small(block_size=64), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_rejects_other_dtypes(dtype):
    q, k, v, *rest = _small()
    if dtype == jnp.int8:
        k, v = k.astype(jnp.int8), v.astype(jnp.int8)
        scale = jnp.ones(k.shape[:3], jnp.float32)
        with pytest.raises(ValueError, match="bf16 or fp16"):
            rpm.ragged_prefill_mgpu(q, k, v, *rest, k_scale=scale, v_scale=scale, interpret=True)
        return
    with pytest.raises(ValueError, match="bf16 or fp16"):
        rpm.ragged_prefill_mgpu(q.astype(dtype), k.astype(dtype), v.astype(dtype), *rest, interpret=True)


def test_rejects_bad_config_and_shapes():
    with pytest.raises(ValueError, match="block_kv 96"):
        rpm.MosaicPrefillConfig(block_kv=96)
    with pytest.raises(ValueError, match="block_q 128"):
        rpm.MosaicPrefillConfig(block_q=128)
    with pytest.raises(ValueError, match="cluster_ctas"):
        rpm.MosaicPrefillConfig(cluster_ctas=3)
    q, k, v, tables, kv_lens, cu = _small()
    with pytest.raises(ValueError, match="cu_q_lens"):
        rpm.ragged_prefill_mgpu(q, k, v, tables, kv_lens, cu[:-1], interpret=True)


def test_supported_only_on_hopper():
    q, k, *_ = _small()
    cc = compat.gpu_compute_capability()
    assert rpm.mgpu_supported(q, k) == (cc is not None and cc[0] == 9)
    assert not rpm.mgpu_supported(q.astype(jnp.float32), k.astype(jnp.float32))
    assert not rpm.mgpu_supported(q, k[:, :, :64])  # rBlock 64 < block_kv 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,group", [(jnp.bfloat16, 4), (jnp.float16, 1)])
def test_gpu_matches_reference(dtype, group):
    q, k, *_ = _small()
    if not rpm.mgpu_supported(q, k):
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(seed(27382))
    q_lens = rng.integers(1, 700, 6).tolist()
    cached = [int(c) * (i % 2) for i, c in enumerate(rng.integers(0, 1500, 6))]
    args = _batch(rng, q_lens=q_lens, cached=cached, block_size=256, head_dim=128, num_kv_heads=2, group=group,
                  dtype=dtype)
    out, residuals = rpm.ragged_prefill_mgpu(*args, return_residuals=True)
    _compare(args, out, residuals, _GPU_OUT_TOL[dtype])
