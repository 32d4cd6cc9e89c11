"""Probe: does a global semaphore array work across CTAs with a dynamic index (the per-tile ready flags
of a dataflow decode layer)? CTA p signals flag[(p + 1) % P] and waits for flag[p] to reach the call's
epoch. A hang means it does not. Also the scalar case of session 7 (one semaphore) for comparison.

Usage (GPU machine, repo root): timeout 60 python3 benchmarks/experiments/session8-probes/sem_array.py
"""
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

P = int(sys.argv[1]) if len(sys.argv) > 1 else 8


def kernel(idx_ref, out_ref):
    c = lax.axis_index("cta")
    flags = pl.get_global(plgpu.SemaphoreType.REGULAR((P,)))
    epoch = idx_ref[0] + 1
    pl.semaphore_signal(flags.at[lax.rem(c + 1, P)])
    pl.semaphore_wait(flags.at[c], epoch, decrement=False)
    out_ref[c] = epoch


f = jax.jit(lambda idx: plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((P,), jnp.int32), grid=(P,),
                                     grid_names=("cta",))(idx))
for call in range(3):
    print(call, f(jnp.array([call], jnp.int32)), flush=True)
print("ok")
