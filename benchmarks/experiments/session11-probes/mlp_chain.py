"""Probe: would a persistent Mosaic GPU kernel for the MLP's two matmuls (gate/up 4096 x 22016, then down
11008 x 4096, one grid barrier between them) beat the decode step's kernels for them?

Session 8's persistent chain (its `--session8c` form: x chunks of an item's successor prefetched, grid
barriers) restricted to those two phases, against the engine's kernels for the same work timed in the
same process: XLA's GEMM for gate/up, SiLU x up, the skinny matmul's down partials. Kernel time a layer
from a trace of 6 layers' calls (distinct weights, x fixed). The chain has no SiLU between its phases (its
phase 2 reads the first 11008 columns of phase 1's output): it bounds from below what a real MLP kernel
would take. Also the math-free stream of the same bytes ("none").

Run from the repository root on the GPU machine (the chain is generated from session 8's patch):
  patch -s -o /tmp/mgpu_chain_x.py benchmarks/experiments/session7-probes/mgpu_chain.py \
      benchmarks/experiments/session8-probes/mgpu_chain_x.patch
  python3 benchmarks/experiments/session11-probes/mlp_chain.py      # JSON to $OUT/mlp_chain.json
"""
import json
import os
import sys

sys.path.insert(0, "scripts")
sys.path.insert(0, "benchmarks/experiments/session7-probes")
sys.path.insert(0, "/tmp")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import mgpu_chain_x as chain  # noqa: E402
from device_trace import gpu_kernel_events  # noqa: E402
from pallas_kernels.skinny_matmul import default_block_sizes, skinny_matmul_partials  # noqa: E402

LAYERS = 6
SHAPES = ((4096, 22016), (11008, 4096))


def per_layer_us(step, match=None):
    ev = gpu_kernel_events(step, 5)
    ev = [e for e in ev if match is None or match in e[0]]
    total = sum(d for _, _, d in ev) / 5 / LAYERS / 1e3
    names = {}
    for n, _, d in ev:
        names[n] = names.get(n, 0) + d / 5 / LAYERS / 1e3
    return round(total, 2), {k: round(v, 2) for k, v in names.items()}


def main():
    key = jax.random.key(0)
    layers = [[jax.random.normal(jax.random.fold_in(key, 10 * l + i), s, jnp.bfloat16) * 0.02
               for i, s in enumerate(SHAPES)] for l in range(LAYERS)]
    x0 = jnp.zeros((chain.ROWS, 4096), jnp.bfloat16).at[0].set(jax.random.normal(key, (4096,), jnp.bfloat16))
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "bytes_per_layer": sum(k * n * 2 for k, n in SHAPES)}

    # The engine's kernels for the same work (batch 1): XLA GEMM, SiLU x up, skinny down partials.
    down_sizes = default_block_sizes(1, 11008, 4096, max_splits=16)

    @jax.jit
    def engine_mlp(x, w_gu, w_dn):
        gu = jnp.dot(x[:1], w_gu)
        h = jax.nn.silu(gu[:, :11008]) * gu[:, 11008:]
        return skinny_matmul_partials(h, w_dn, block_sizes=down_sizes)

    step = lambda: [engine_mlp(x0, *ws) for ws in layers]
    res["engine"] = per_layer_us(step)
    print("engine", res["engine"], flush=True)

    for splits, mode, slots in (((1, 2), "xprefetch", 8), ((2, 2), "xprefetch", 8), ((1, 4), "xprefetch", 8),
                                ((1, 2), "xprefetch", 12), ((1, 2), "none", 8)):
        name = f"chain_s{splits[0]}-{splits[1]}_{mode}_slots{slots}"
        try:
            f = chain.make(SHAPES, splits, 128, 64, slots, xslots=4, barriers=True, x_mode=mode, store=True)
            n = [0]

            def call(ws):
                n[0] += 1
                return f(x0, ws, jnp.array([n[0] - 1], jnp.int32))
            outs = jax.block_until_ready(call(layers[0]))
            row = {}
            if mode == "xprefetch":
                ref = chain.reference(x0, layers[0], SHAPES, splits)
                row["max_err"] = [float(np.max(np.abs(np.asarray(o.astype(jnp.float32), np.float64) - r)))
                                  for o, r in zip(outs, ref)]
                row["max_ref"] = [float(np.max(np.abs(r))) for r in ref]
            row["us_per_layer"], _ = per_layer_us(lambda: [call(ws) for ws in layers], "mosaic")
            res[name] = row
        except Exception as e:
            res[name] = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        print(name, res[name], flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "mlp_chain.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
