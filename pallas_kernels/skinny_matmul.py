"""Skinny matmul: a few token rows times a weight matrix, at the speed of reading the weights.

Decode multiplies [M, K] activations (M = batch tokens, 1..64) by [K, N] weights. The work is
tiny; the cost is streaming K * N weights from HBM once. The kernel grid runs over (column tiles of
`block_n`, K splits): each program walks its share of K in `block_k` rows, loading [block_k, block_n]
tiles of the row-major weights (every tile row is `block_n` contiguous elements) and accumulating
acc[rows, block_n] += x_tile @ w_tile in float32 on the tensor cores (x padded to the 16 rows tl.dot
needs by masked loads, so nothing is copied on the way in). Splitting K gives enough programs to keep
every SM's loads in flight whatever N; the split partials [splits, M, N] float32 (only the M real rows
are written, a small fraction of the weight bytes) are summed by one XLA reduction that also casts.
With one split the kernel writes the output directly.

Any K and N work: a shape the tiles do not divide is read with masks on its last tile (zeros past
the end), which costs a little on every tile of that dimension, so the default chooser picks tiles
that divide the Llama shapes (K, N in {4096, 11008, 12288, 22016, 32000} are all multiples of 256).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.validation import MIN_DOT_ROWS, check_dot_tile, check_launch

MAX_ROWS = 64
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# About 2.5 programs per SM of an H100/H200 (132 SMs), each with 3 stages of 16 KB weight tiles in
# flight: the best of the sweeps (scripts/bench_skinny_matmul.py; figures in benchmarks/NOTES.md).
DEFAULT_TARGET_PROGRAMS = 320


def _pow2_factor(x: int, cap: int) -> int:
    """Largest power of two dividing x, at most cap."""
    return min(x & -x, cap)


@dataclasses.dataclass(frozen=True)
class SkinnyBlockSizes:
    """Schedule of the skinny matmul kernel.

    block_n: weight columns per program (a power of two >= 16; each weight tile row is block_n
      contiguous elements).
    block_k: weight rows per loop iteration (a power of two >= 16).
    k_splits: programs sharing one column tile, each over a contiguous run of K; the split count
      actually used is ceil(chunks / ceil(chunks / k_splits)) with chunks = ceil(K / block_k), so no
      program is empty.
    num_warps, num_stages: Triton launch parameters (num_stages pipelines the weight loads).
    """

    block_n: int = 64
    block_k: int = 128
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            check_dot_tile(name, getattr(self, name))
        if self.k_splits < 1:
            raise ValueError(f"k_splits {self.k_splits} must be >= 1")
        check_launch(self.num_warps, self.num_stages)

    def plan(self, k: int) -> tuple[int, int, int]:
        """(chunks of block_k rows in K, chunks per split, splits used) for a K of k rows."""
        chunks = pl.cdiv(k, self.block_k)
        per_split = pl.cdiv(chunks, min(self.k_splits, chunks))
        return chunks, per_split, pl.cdiv(chunks, per_split)


def default_block_sizes(m: int, k: int, n: int, *, target_programs: int = DEFAULT_TARGET_PROGRAMS,
                        max_splits: int | None = None) -> SkinnyBlockSizes:
    """Block sizes for x [m, k] @ w [k, n]: tiles that divide the shape, K split to fill the GPU.

    block_n 64 and block_k 128 (16 KB bf16 weight tiles, 3 stages in flight, 4 warps), and K split
    into round(target_programs / column tiles) runs (4096x4096: 5 splits, 320 programs; 11008x4096: 5;
    4096x11008 and 4096x12288: 2; 4096x22016 and 4096x32000: 1, no reduction). On an H200 this schedule
    was within ~10% (mostly run-to-run noise) of the best swept one at M = 1 and 8. max_splits bounds
    the split for a consumer of the partials that sums only so many (rms_norm.MAX_PARTS).
    """
    del m  # up to 64 rows the weight stream dominates; the rows change nothing here
    block_n = max(MIN_DOT_ROWS, _pow2_factor(n, 64)) if n % MIN_DOT_ROWS == 0 else 64
    block_k = max(MIN_DOT_ROWS, _pow2_factor(k, 128)) if k % MIN_DOT_ROWS == 0 else 128
    tiles = pl.cdiv(n, block_n)
    splits = max(1, min(round(target_programs / tiles), pl.cdiv(k, block_k), max_splits or k))
    return SkinnyBlockSizes(block_n=block_n, block_k=block_k, k_splits=splits, num_warps=4, num_stages=3)


def _skinny_kernel(
    x_ref,  # [m, k]
    w_ref,  # [k, n]
    o_ref,  # [splits, m, n] float32 partials, or [m, n] out_dtype with one split
    *,
    m: int,
    k: int,
    n: int,
    rows: int,
    block_n: int,
    block_k: int,
    chunks: int,
    per_split: int,
    split_out: bool,
    precision,
):
    col_tile, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(col_tile * block_n, block_n)
    row_ids = jnp.arange(rows, dtype=jnp.int32)
    col_ids = n0 + jnp.arange(block_n, dtype=jnp.int32)
    k_ids = jnp.arange(block_k, dtype=jnp.int32)
    mask_k, mask_n = k % block_k != 0, n % block_n != 0
    first = split * per_split
    # Static trip count when the splits divide the chunks (the usual case): Triton pipelines it best.
    count = per_split if chunks % per_split == 0 else jnp.minimum(per_split, chunks - first)

    def body(i, acc):
        k0 = pl.multiple_of((first + i) * block_k, block_k)
        x_mask = row_ids[:, None] < m  # [rows, 1]: padding rows read as zeros, never from memory
        if mask_k:
            x_mask = x_mask & (k0 + k_ids[None, :] < k)
        x = compat.triton_masked_load(x_ref.at[pl.ds(0, rows), pl.ds(k0, block_k)], x_mask, 0)  # [rows, block_k]
        w_tile = w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)]
        if mask_k or mask_n:
            w_mask = (k0 + k_ids[:, None] < k) & (col_ids[None, :] < n)  # [block_k, block_n]
            w = compat.triton_masked_load(w_tile, w_mask, 0)
        else:
            w = w_tile[...]  # [block_k, block_n]
        return acc + jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, count, body, jnp.zeros((rows, block_n), jnp.float32))  # [rows, block_n]
    # Only the real rows (and columns): the padding rows would be 16x the bytes at M = 1.
    out_mask = (row_ids[:, None] < m) & (col_ids[None, :] < n)
    if split_out:
        compat.triton_masked_store(o_ref.at[split, pl.ds(0, rows), pl.ds(n0, block_n)], acc, out_mask)
    else:
        compat.triton_masked_store(o_ref.at[pl.ds(0, rows), pl.ds(n0, block_n)], acc.astype(o_ref.dtype), out_mask)


def _skinny_call(x, w, *, out_dtype, block_sizes: SkinnyBlockSizes, interpret: bool, partials: bool = False):
    """The kernel alone: [splits, M, N] float32 partials (always with `partials`), or [M, N] out_dtype
    when K is not split."""
    m, k = x.shape
    n = w.shape[1]
    rows = max(MIN_DOT_ROWS, 1 << (m - 1).bit_length())  # token rows padded by masked loads for tl.dot
    chunks, per_split, splits = block_sizes.plan(k)
    split_out = partials or splits > 1
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_skinny_kernel, m=m, k=k, n=n, rows=rows, block_n=block_sizes.block_n,
                               block_k=block_sizes.block_k, chunks=chunks, per_split=per_split,
                               split_out=split_out, precision=precision)
    out_shape = (jax.ShapeDtypeStruct((splits, m, n), jnp.float32) if split_out
                 else jax.ShapeDtypeStruct((m, n), out_dtype))
    whole = pl.no_block_spec  # tiles are addressed inside the kernel (masked at the edges), never by BlockSpecs
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_sizes.block_n), splits),
        in_specs=[whole, whole],
        out_specs=whole,
        out_shape=out_shape,
        compiler_params=compat.triton_compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(x, w)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def _skinny_matmul(x, w, *, out_dtype, block_sizes: SkinnyBlockSizes, interpret: bool):
    out = _skinny_call(x, w, out_dtype=out_dtype, block_sizes=block_sizes, interpret=interpret)
    if out.ndim == 3:
        out = jnp.sum(out, axis=0).astype(out_dtype)  # [m, n]; one XLA reduction fusion
    return out


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def _skinny_partials(x, w, *, block_sizes: SkinnyBlockSizes, interpret: bool):
    return _skinny_call(x, w, out_dtype=jnp.float32, block_sizes=block_sizes, interpret=interpret, partials=True)


def check_skinny_matmul_args(x, w, out_dtype=None) -> None:
    """Raise ValueError naming the value and the limit for malformed skinny-matmul arguments."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [K, N], got shapes {x.shape} and {w.shape}")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x has {m} rows; the skinny matmul takes 1 to {MAX_ROWS} (use jnp.dot for more)")
    if w.shape[0] != k:
        raise ValueError(f"x has K = {k} columns but w has {w.shape[0]} rows")
    if k < 1 or w.shape[1] < 1:
        raise ValueError(f"K {k} and N {w.shape[1]} must be >= 1")
    names = ", ".join(jnp.dtype(d).name for d in DTYPES)
    if x.dtype not in DTYPES or w.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} and w dtype {w.dtype} must be among {names}")
    if x.dtype != w.dtype:
        raise ValueError(f"x dtype {x.dtype} must equal w dtype {w.dtype}")
    if out_dtype is not None and not jnp.issubdtype(out_dtype, jnp.floating):
        raise ValueError(f"out_dtype {out_dtype} must be a floating dtype")


def skinny_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype=None,
    block_sizes: SkinnyBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """x @ w for a few rows of x, streaming w once with float32 accumulation.

    Args:
      x: [M, K] activations, 1 <= M <= 64 (bfloat16, float16 or float32).
      w: [K, N] row-major weights, the same dtype as x.
      out_dtype: dtype of the result, default x.dtype.
      block_sizes: kernel schedule (default `default_block_sizes(M, K, N)`).
      interpret: run the kernel in the Pallas interpreter; None means on unless on a GPU.

    Returns:
      [M, N] in out_dtype.
    """
    check_skinny_matmul_args(x, w, out_dtype)
    interpret = compat.default_interpret(interpret)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if block_sizes is None:
        block_sizes = default_block_sizes(x.shape[0], x.shape[1], w.shape[1])
    return _skinny_matmul(x, w, out_dtype=out_dtype, block_sizes=block_sizes, interpret=interpret)


def skinny_matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """jnp.dot with float32 accumulation (full-precision float32 products): [M, K] @ [K, N] -> [M, N]."""
    out = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def skinny_matmul_partials(
    x: jax.Array,
    w: jax.Array,
    *,
    block_sizes: SkinnyBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """x @ w as the kernel's unreduced split-K partials: [splits, M, N] float32 (splits >= 1), summing to
    the product. For a consumer that adds them itself (rms_norm.add_rms_norm, the next layer's residual
    add) instead of paying one more kernel for the sum. Arguments as `skinny_matmul`."""
    check_skinny_matmul_args(x, w)
    if block_sizes is None:
        block_sizes = default_block_sizes(x.shape[0], x.shape[1], w.shape[1])
    return _skinny_partials(x, w, block_sizes=block_sizes, interpret=compat.default_interpret(interpret))
