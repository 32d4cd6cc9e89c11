"""Residual add + RMSNorm in one Pallas kernel: h = x + delta, normed = weight * RMSNorm(h).

A Llama decode step at batch 1 runs, twice per layer, the residual add, the RMSNorm reduction and
the RMSNorm scale as three XLA kernels of ~1.4 us each, all launch latency. This kernel does the
three in one launch and one pass: the grid runs over blocks of `block_rows` token rows; each program
loads its rows' whole hidden dimension (D padded to a power of two by masked loads), adds, reduces and
scales in registers, and stores h and normed. No loop over D: a program holds block_rows x D_pow2
elements, so D is limited to MAX_DIM. delta may also come as a matmul's unreduced [S, T, D] float32
split-K partials (skinny_matmul_partials), which the kernel sums first: the o and down projections'
sums then cost no kernel of their own.

Rounding points are HF Llama's (and jaxllm.model.llama.RMSNorm's): h = x + delta rounded to x.dtype;
n = h * rsqrt(mean(h^2) + eps) in float32, rounded to x.dtype; normed = weight * n rounded to x.dtype.
The kernel computes each add and product in float32 and rounds once; for bfloat16 and float16 operands
that equals the correctly rounded result (float32 has more than twice their precision plus two bits),
so h is bitwise x + delta and normed differs from the reference only through the reduction order and
rsqrt's last float32 bit (now and then 1 ulp of x.dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.validation import check_launch, is_pow2

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# One program holds its rows' whole (padded) hidden dimension in registers: at 16 warps and 16K
# elements that is 32 float32 values a thread per live tensor, about what fits without spilling.
MAX_DIM = 16384
MAX_PROGRAM_ELEMENTS = 16384
# Split-K partials a delta may come as (each one more [block_rows, D] load a program).
MAX_PARTS = 16


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class RmsNormBlockSizes:
    """Schedule of the add + RMSNorm kernel.

    block_rows: token rows per program (a power of two); block_rows * next_pow2(D) must be at most
      MAX_PROGRAM_ELEMENTS.
    num_warps: Triton warps per program (a power of two <= 16).
    """

    block_rows: int = 1
    num_warps: int = 4

    def __post_init__(self):
        if not is_pow2(self.block_rows):
            raise ValueError(f"block_rows {self.block_rows} must be a power of two >= 1")
        check_launch(self.num_warps, 1)


def default_block_sizes(t: int, d: int) -> RmsNormBlockSizes:
    """Block sizes for x [t, d]. UNMEASURED: chosen by reasoning, not by a sweep on a GPU.

    Decode (a few rows) is latency bound, so each program takes as few rows as give it a few thousand
    elements: one row per program for D >= 4096 (T programs run side by side on T SMs), more rows for
    small D, never more than T rounded up to a power of two. Warps grow with the elements so a thread
    holds at most ~32 values of each tensor: 4 warps up to 4096 elements, 8 at 8192, 16 at 16384.
    """
    d_pow2 = _next_pow2(d)
    block_rows = max(1, min(4096 // d_pow2, _next_pow2(t)))
    elements = block_rows * d_pow2
    num_warps = 4 if elements <= 4096 else min(16, elements // 1024)
    return RmsNormBlockSizes(block_rows=block_rows, num_warps=num_warps)


def _rms_norm_kernel(*refs, t: int, d: int, d_pow2: int, block_rows: int, eps: float, has_delta: bool,
                     num_parts: int):
    if has_delta:
        # [t, d], [t, d] (or [num_parts, t, d] float32 partials), [d] -> [t, d], [t, d]
        x_ref, delta_ref, w_ref, normed_ref, h_ref = refs
    else:
        (x_ref, w_ref, normed_ref), delta_ref, h_ref = refs, None, None  # [t, d], [d] -> [t, d]
    r0 = pl.program_id(0) * block_rows
    rows, cols = pl.ds(r0, block_rows), pl.ds(0, d_pow2)
    # Masks only where the shape needs them (statically): unmasked loads vectorise better.
    mask_rows, mask_cols = t % block_rows != 0, d != d_pow2
    if mask_rows or mask_cols:
        row_ids = r0 + jnp.arange(block_rows, dtype=jnp.int32)
        col_ids = jnp.arange(d_pow2, dtype=jnp.int32)
        mask = (row_ids[:, None] < t) & (col_ids[None, :] < d)  # [block_rows, d_pow2]
        # Zeros past the edges: padding columns add nothing to the sum of squares; padding rows are
        # never stored. Nothing past the edges is read.
        load = lambda ref, *lead: compat.triton_masked_load(ref.at[(*lead, rows, cols)], mask, 0.0)
        store = lambda ref, v: compat.triton_masked_store(ref.at[rows, cols], v, mask)
    else:
        load = lambda ref, *lead: ref[(*lead, rows, cols)]

        def store(ref, v):
            ref[rows, cols] = v
    if mask_cols:
        w = compat.triton_masked_load(w_ref.at[cols], jnp.arange(d_pow2, dtype=jnp.int32) < d, 0.0)  # [d_pow2]
    else:
        w = w_ref[cols]  # [d_pow2]

    dtype = x_ref.dtype
    x32 = load(x_ref).astype(jnp.float32)  # [block_rows, d_pow2]
    if has_delta:
        if num_parts:  # the producer's split-K partials: their sum rounded to x.dtype, as its output would be
            # Scalar indices as int32 values: a Python int in a masked load's index has no shape.
            delta = load(delta_ref, jnp.int32(0))
            for part in range(1, num_parts):
                delta = delta + load(delta_ref, jnp.int32(part))
            delta = delta.astype(dtype)
        else:
            delta = load(delta_ref)
        h = (x32 + delta.astype(jnp.float32)).astype(dtype)  # x + delta, rounded once
        store(h_ref, h)
        h32 = h.astype(jnp.float32)
    else:
        h32 = x32
    ms = jnp.sum(h32 * h32, axis=1, keepdims=True) / d  # [block_rows, 1]; the real D, not d_pow2
    n = (h32 * jax.lax.rsqrt(ms + eps)).astype(dtype)
    normed = (w.astype(jnp.float32)[None, :] * n.astype(jnp.float32)).astype(dtype)  # [block_rows, d_pow2]
    store(normed_ref, normed)


@functools.partial(jax.jit, static_argnames=("eps", "block_sizes", "interpret"))
def _rms_norm_call(x, delta, weight, *, eps: float, block_sizes: RmsNormBlockSizes, interpret: bool):
    """The kernel: (normed, h) with delta, (normed,) without."""
    t, d = x.shape
    has_delta = delta is not None
    kernel = functools.partial(_rms_norm_kernel, t=t, d=d, d_pow2=_next_pow2(d), block_rows=block_sizes.block_rows,
                               eps=eps, has_delta=has_delta, num_parts=delta.shape[0] if has_delta and delta.ndim == 3 else 0)
    operands = (x, delta, weight) if has_delta else (x, weight)
    out = jax.ShapeDtypeStruct((t, d), x.dtype)
    whole = pl.no_block_spec  # rows are addressed inside the kernel (masked at the edges), never by BlockSpecs
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, block_sizes.block_rows),),
        in_specs=[whole] * len(operands),
        out_specs=[whole, whole] if has_delta else [whole],
        out_shape=[out, out] if has_delta else [out],
        compiler_params=compat.triton_compiler_params(block_sizes.num_warps, 1),
        interpret=interpret,
        name="add_rms_norm" if has_delta else "rms_norm",
    )(*operands)


def check_rms_norm_args(x, delta, weight, eps, block_sizes: RmsNormBlockSizes | None = None) -> None:
    """Raise ValueError naming the value and the limit for malformed (add_)rms_norm arguments."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got shape {x.shape}")
    t, d = x.shape
    if t < 1 or d < 1:
        raise ValueError(f"x shape {x.shape}: T {t} and D {d} must be >= 1")
    if d > MAX_DIM:
        raise ValueError(f"D {d} exceeds {MAX_DIM}, the most the single-pass kernel holds in one program")
    partials = delta is not None and delta.ndim == 3
    if partials and (delta.shape[1:] != x.shape or not 1 <= delta.shape[0] <= MAX_PARTS):
        raise ValueError(f"delta partials shape {delta.shape} must be [S, *{x.shape}] with 1 <= S <= {MAX_PARTS}")
    if partials and delta.dtype != jnp.float32:
        raise ValueError(f"delta partials dtype {delta.dtype} must be float32")
    if delta is not None and not partials and delta.shape != x.shape:
        raise ValueError(f"delta shape {delta.shape} != x shape {x.shape}")
    if weight.shape != (d,):
        raise ValueError(f"weight shape {weight.shape} != (D,) = ({d},)")
    names = ", ".join(dt.name for dt in DTYPES)
    if jnp.dtype(x.dtype) not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported; use one of {names}")
    for name, arr in (("delta", None if partials else delta), ("weight", weight)):
        if arr is not None and arr.dtype != x.dtype:
            raise ValueError(f"{name} dtype {arr.dtype} must equal x dtype {x.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < float("inf"):
        raise ValueError(f"eps {eps!r} must be a finite number > 0 (static, not an array)")
    if block_sizes is not None and block_sizes.block_rows * _next_pow2(d) > MAX_PROGRAM_ELEMENTS:
        raise ValueError(f"block_rows {block_sizes.block_rows} x padded D {_next_pow2(d)} exceeds "
                         f"{MAX_PROGRAM_ELEMENTS} elements a program")


def add_rms_norm(
    x: jax.Array,
    delta: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    block_sizes: RmsNormBlockSizes | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The residual add and RMSNorm in one kernel.

    Args:
      x: [T, D] residual stream (bfloat16, float16 or float32), D <= MAX_DIM.
      delta: [T, D] the block output added to it, x's dtype; or its [S, T, D] float32 split-K partials
        (skinny_matmul_partials), summed and rounded to x.dtype first, as the finished product would be.
      weight: [D] RMSNorm scale, x's dtype.
      eps: added to the mean square (> 0).
      block_sizes: kernel schedule (default `default_block_sizes(T, D)`).
      interpret: run the kernel in the Pallas interpreter; None means on unless on a GPU.

    Returns:
      (normed, h), both [T, D] in x.dtype: h = x + delta, normed = weight * RMSNorm(h) with
      `add_rms_norm_reference`'s rounding points.
    """
    check_rms_norm_args(x, delta, weight, eps, block_sizes)
    block_sizes = block_sizes or default_block_sizes(*x.shape)
    normed, h = _rms_norm_call(x, delta, weight, eps=float(eps), block_sizes=block_sizes,
                               interpret=compat.default_interpret(interpret))
    return normed, h


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    block_sizes: RmsNormBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """weight * RMSNorm(x) for x [T, D] as one kernel (add_rms_norm with the add compiled out): [T, D] x.dtype."""
    check_rms_norm_args(x, None, weight, eps, block_sizes)
    block_sizes = block_sizes or default_block_sizes(*x.shape)
    (normed,) = _rms_norm_call(x, None, weight, eps=float(eps), block_sizes=block_sizes,
                               interpret=compat.default_interpret(interpret))
    return normed


def rms_norm_reference(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    """HF Llama's RMSNorm over the last axis: normalise in float32, round to x.dtype, then scale."""
    x32 = x.astype(jnp.float32)
    n = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weight * n


def add_rms_norm_reference(x: jax.Array, delta: jax.Array, weight: jax.Array, *, eps: float
                           ) -> tuple[jax.Array, jax.Array]:
    """(rms_norm_reference(x + delta), x + delta), the add in x.dtype: [T, D] -> ([T, D], [T, D]).
    delta may be [S, T, D] float32 partials: their sum, rounded to x.dtype, is added."""
    if delta.ndim == 3:
        delta = jnp.sum(delta, axis=0).astype(x.dtype)
    h = x + delta
    return rms_norm_reference(h, weight, eps=eps), h
