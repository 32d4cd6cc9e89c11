import jax, jax.numpy as jnp, sys
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
BK, BN, M = 128, 64, 8
variant = sys.argv[1]
def kernel(w_ref, x_ref, o_ref, w_smem, x_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(w_ref, w_smem, bar.at[0]); plgpu.barrier_wait(bar.at[0])
    plgpu.copy_gmem_to_smem(x_ref, x_smem, bar.at[1]); plgpu.barrier_wait(bar.at[1])
    def mm(acc_ref):
        plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_smem, (1, 0)), plgpu.transpose_ref(x_smem, (1, 0)))
        return acc_ref[...]
    acc = pl.run_scoped(mm, plgpu.ACC((BN, M), jnp.float32))   # [64 n, 8 m]
    accb = acc.astype(jnp.bfloat16)
    if variant == "T":
        plgpu.transpose_ref(o_smem, (1, 0))[...] = accb
    elif variant == "to_layout":
        plgpu.transpose_ref(o_smem, (1, 0))[...] = plgpu.layout_cast(accb, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)
t = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((M, BN), jnp.bfloat16),
                 scratch_types=[plgpu.SMEM((BK, BN), jnp.bfloat16, transforms=t), plgpu.SMEM((M, BK), jnp.bfloat16, transforms=t),
                                plgpu.SMEM((M, BN), jnp.bfloat16, transforms=t), plgpu.Barrier(num_barriers=2)])
import numpy as np
w = jax.random.normal(jax.random.key(0), (BK, BN), jnp.bfloat16); x = jax.random.normal(jax.random.key(1), (M, BK), jnp.bfloat16)
if jax.devices()[0].platform != "gpu":
    print(variant, len(jax.jit(f).trace(w, x).lower(lowering_platforms=("cuda",)).as_text())); sys.exit()
out = np.asarray(jax.jit(f)(w, x).astype(jnp.float32))
ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
print(variant, "transposed store: max |err|", float(np.abs(out - ref).max()), "max |ref|", float(np.abs(ref).max()))
