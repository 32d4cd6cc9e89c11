"""Probe: M=1 decode matmul speed by weight layout: XLA on [K, N], XLA on [N, K], skinny kernel on [K, N]."""
import sys, json, os, collections
sys.path.insert(0, "scripts")
import numpy as np, jax, jax.numpy as jnp
from jax import lax
from device_trace import gpu_kernel_events
from pallas_kernels.skinny_matmul import skinny_matmul
from pallas_kernels import compat
compat.silence_triton_deprecation()
COPIES = 8
res = {}
key = jax.random.key(1)
for (K, N) in ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096), (4096, 32000)):
    ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) for i in range(COPIES)]
    wts = [jnp.asarray(w.T) for w in ws]
    x = jax.random.normal(key, (1, K), jnp.bfloat16)
    fns = {
        "xla_kn": (jax.jit(lambda x, ws: [x @ w for w in ws]), ws),
        "xla_nk": (jax.jit(lambda x, ws: [lax.dot_general(x, w, (((1,), (1,)), ((), ()))) for w in ws]), wts),
        "skinny_kn": (jax.jit(lambda x, ws: [skinny_matmul(x, w) for w in ws]), ws),
    }
    row = {}
    for name, (f, arg) in fns.items():
        ev = gpu_kernel_events(lambda: f(x, arg), 5)
        tot = collections.defaultdict(float)
        for n, s, d in ev:
            tot[n] += d / 1e3
        us = sum(tot.values()) / (5 * COPIES)
        row[name] = dict(us=round(us, 2), tbps=round(K * N * 2 / us / 1e6, 3),
                         kernels={k[:40]: round(v / (5 * COPIES), 2) for k, v in tot.items()})
    res[f"{K}x{N}"] = row
    print(K, N, {k: (v["us"], v["tbps"]) for k, v in row.items()}, flush=True)
    del ws, wts
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gemv_layout.json"), "w"), indent=1)
