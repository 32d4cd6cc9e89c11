"""Probe: what bounds int8 decode. 128K batch 1, 32 heads, rBlock 1024, per-call time (check script's timer)."""
import os, sys, json
sys.path.insert(0, "scripts")
import jax, jax.numpy as jnp, numpy as np
from check_ragged_decode_gpu import _time, NUM_LAYERS
from pallas_kernels.ragged_decode import ragged_decode, default_block_sizes, DecodeBlockSizes
from pallas_kernels import compat
compat.silence_triton_deprecation()
length, heads, bs = 131072, 32, 1024
nb = length // bs
tables = jnp.arange(nb, dtype=jnp.int32)[None]
kv = jnp.asarray([length], jnp.int32)
rows = []
def run(name, d, dtype, bsz=None):
    keys = jax.random.split(jax.random.key(1), 2 * NUM_LAYERS)
    shape = (nb, heads, bs, d)
    if dtype == "int8":
        pools = [jax.random.randint(keys[i], shape, -127, 128, jnp.int32).astype(jnp.int8) for i in range(2 * NUM_LAYERS)]
        sc = jnp.full(shape[:3], 0.01, jnp.float32)
        nbytes = 2 * length * heads * (d + 4)
    else:
        pools = [jax.random.normal(keys[i], shape, jnp.float32).astype(dtype) for i in range(2 * NUM_LAYERS)]
        sc = None
        nbytes = 2 * length * heads * d * jnp.dtype(dtype).itemsize
    q = jax.random.normal(keys[0], (1, heads, d), jnp.bfloat16)
    @jax.jit
    def step(q, pools, sc):
        acc = jnp.zeros(q.shape, jnp.float32)
        for i in range(NUM_LAYERS):
            acc += ragged_decode(q, pools[2 * i], pools[2 * i + 1], tables, kv, k_scale=sc, v_scale=sc,
                                 block_sizes=bsz).astype(jnp.float32)
        return acc
    t = _time(step, q, pools, sc) / NUM_LAYERS
    row = dict(case=name, head_dim=d, dtype=str(dtype), us=round(t * 1e6, 1), tb_s=round(nbytes / t / 1e12, 3),
               env=os.environ.get("JAXLLM_PROBE_NO_SCALES", ""))
    print(row, flush=True); rows.append(row)
    del pools
mode = sys.argv[1]
if mode == "noscales":
    run("int8 d128, scale loads replaced by a constant (timing only)", 128, "int8")
else:
    run("int8 d128 (default)", 128, "int8")
    run("int8 d64", 64, "int8")
    run("bf16 d128", 128, jnp.bfloat16)
    run("bf16 d64 (int8 d128's KV bytes a token)", 64, jnp.bfloat16)
    run("bf16 d64, 128-token tiles", 64, jnp.bfloat16, DecodeBlockSizes(block_k=128))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"int8_bound-{mode}.json"), "w"), indent=1)
