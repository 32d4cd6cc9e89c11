"""Attention problems the attention benchmarks share: rBlock tables and pools, ragged prefill batches
with their float32 reference rows, and the dense peers (cuDNN, XLA, JAX's Pallas mha) that run the same
work group by group. Shapes follow pallas_kernels: pools [blocks, kv_heads, block, head_dim], packed
queries [tokens, heads, head_dim], dense [seqs, tokens, heads, head_dim].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.residuals import merge_partials


def consecutive_tables(blocks_per_seq, width: int) -> np.ndarray:
    """Block tables [seqs, width] int32 giving each sequence the next blocks_per_seq[s] rBlock ids in
    order, from 0 (the allocator's common case); entries past a sequence's blocks are 0."""
    tables = np.zeros((len(blocks_per_seq), width), np.int32)
    at = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = np.arange(at, at + n)
        at += n
    return tables


def pool_from_dense(x, lens, block: int):
    """Seq-major [B, S, H, D] -> head-major rBlock pool [N, H, block, D] holding each sequence's first
    lens[b] tokens in consecutive rBlocks, and its tables [B, max blocks] (consecutive ids)."""
    b, s, h, d = x.shape
    nb = -(-np.asarray(lens) // block)
    seq = np.repeat(np.arange(b), nb)
    blk = np.concatenate([np.arange(n) for n in nb])
    pool = x.reshape(b, s // block, block, h, d)[seq, blk].transpose(0, 2, 1, 3)
    return pool, jnp.asarray(consecutive_tables(nb, s // block))


def prefill_problem(normal, groups, heads, block, ref_rows: int):
    """Dense per-group inputs for the peers and the same values as a packed batch over an rBlock pool.

    normal(shape) draws fresh bf16 inputs; groups: (sequences, query tokens each, cached prefix each);
    heads: (q heads, kv heads, head_dim). Returns (dense, packed, reference rows, causal flops)."""
    hq, hkv, d = heads
    dense, q_parts, k_blocks, v_blocks, rows = [], [], [], [], []
    kv_lens, q_lens, nblocks = [], [], []
    for count, q_len, prefix in groups:
        length = prefix + q_len
        q = normal((count, q_len, hq, d))
        k, v = normal((count, length, hkv, d)), normal((count, length, hkv, d))
        dense.append((q, k[:, :prefix] if prefix else None, v[:, :prefix] if prefix else None,
                      k[:, prefix:], v[:, prefix:]))
        padded = -(-length // block) * block
        for x, out in ((k, k_blocks), (v, v_blocks)):
            x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
            out.append(x.reshape(count * padded // block, block, hkv, d).transpose(0, 2, 1, 3))
        q_parts.append(q.reshape(count * q_len, hq, d))
        kv_lens += [length] * count
        q_lens += [q_len] * count
        nblocks += [padded // block] * count
        rows.append((q[0, -ref_rows:], k[0], v[0], prefix + q_len - min(ref_rows, q_len)))
    tables = consecutive_tables(nblocks, max(nblocks))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    packed = (jnp.concatenate(q_parts), jnp.concatenate(k_blocks), jnp.concatenate(v_blocks), jnp.asarray(tables),
              jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu))
    flops = sum(4.0 * hq * d * count * (q_len * prefix + q_len * (q_len + 1) / 2) for count, q_len, prefix in groups)
    return dense, packed, rows, flops


def reference_rows(q, k, v, first_pos):
    """float32 causal attention of one sequence's last query rows q [R, H, D] over its keys k, v [L, Hkv, D]."""
    r, hq, d = q.shape
    g = hq // k.shape[1]
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("rkgd,lkd->kgrl", q.astype(jnp.float32).reshape(r, -1, g, d), k.astype(jnp.float32),
                   precision=hi) / math.sqrt(d)
    visible = jnp.arange(k.shape[0])[None, :] <= (first_pos + jnp.arange(r))[:, None]  # [R, L]
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.einsum("kgrl,lkd->rkgd", p, v.astype(jnp.float32), precision=hi).reshape(r, hq, d)


def prefill_errors(groups, ref_rows: int):
    """(packed_err, group_err): err_of functions giving the max |out - ref| over each group's first
    sequence's last min(ref_rows, tokens) rows, refs being reference_rows' results per group.

    packed_err reads a packed output [tokens, heads, head_dim] (groups in order); group_err reads one
    dense output [seqs, tokens, heads, head_dim] per group.
    """
    nrows = [min(ref_rows, q) for _, q, _ in groups]
    starts = np.cumsum([0] + [c * q for c, q, _ in groups])

    def packed_err(out, refs):
        return max(float(jnp.max(jnp.abs(out[s + q - r: s + q].astype(jnp.float32) - ref)))
                   for s, (_, q, _), ref, r in zip(starts, groups, refs, nrows))

    def group_err(outs, refs):
        return max(float(jnp.max(jnp.abs(o[0, -r:].astype(jnp.float32) - ref)))
                   for o, ref, r in zip(outs, refs, nrows))

    return packed_err, group_err


def peer_prefill(part):
    """fn(shared=groups, layer=()) running each group as a dense batch; part(q, k, v, causal) -> (out, lse)."""
    def fn(groups, _):
        outs = []
        for q, k_pre, v_pre, k_new, v_new in groups:
            if k_pre is None:
                outs.append(part(q, k_new, v_new, True, residual=False))
                continue
            o1, l1 = part(q, k_pre, v_pre, False, residual=True)  # every new token sees the whole prefix
            o2, l2 = part(q, k_new, v_new, True, residual=True)  # top-left causal = causal among new tokens
            lse = jnp.stack([l1, l2]).astype(jnp.float32)
            out, _, _ = merge_partials(jnp.stack([o1, o2]), lse, jnp.ones_like(lse))
            outs.append(out.astype(q.dtype))
        return outs
    return fn


def sdpa_part(impl):
    """part(q, k, v, causal, residual) for peer_prefill through jax.nn.dot_product_attention."""
    def part(q, k, v, causal, residual):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl,
                                            return_residual=residual)  # lse [B, T, H], natural log
    return part


def mha_part(interpret):
    """part(q, k, v, causal, residual) for peer_prefill through JAX's Pallas attention.mha."""
    from jax.experimental.pallas.ops.gpu import attention as fa

    def part(q, k, v, causal, residual):
        res = fa.mha(q, k, v, None, sm_scale=1 / math.sqrt(q.shape[-1]), causal=causal, interpret=interpret,
                     return_residuals=residual)
        if not residual:
            return res
        out, lse2 = res  # lse in base 2, [B, H, T]
        return out, jnp.swapaxes(lse2, 1, 2) * math.log(2)
    return part
