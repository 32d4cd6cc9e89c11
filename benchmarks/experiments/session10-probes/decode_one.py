"""One ragged_decode call at 128K, batch 1, 32x128 MHA, rBlock 1024: int8 (with scales) or bf16, run 3 times."""
import sys
import jax, jax.numpy as jnp
from pallas_kernels.ragged_decode import ragged_decode
from pallas_kernels import compat
compat.silence_triton_deprecation()
dtype = sys.argv[1]
length, heads, d, bs = 131072, 32, 128, 1024
nb = length // bs
tables = jnp.arange(nb, dtype=jnp.int32)[None]
kv = jnp.asarray([length], jnp.int32)
shape = (nb, heads, bs, d)
q = jax.random.normal(jax.random.key(0), (1, heads, d), jnp.bfloat16)
if dtype == "int8":
    k = jax.random.randint(jax.random.key(1), shape, -127, 128, jnp.int32).astype(jnp.int8)
    v = jax.random.randint(jax.random.key(2), shape, -127, 128, jnp.int32).astype(jnp.int8)
    sc = jnp.full(shape[:3], 0.01, jnp.float32)
    f = jax.jit(lambda q, k, v, sc: ragged_decode(q, k, v, tables, kv, k_scale=sc, v_scale=sc))
    args = (q, k, v, sc)
else:
    k = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    f = jax.jit(lambda q, k, v: ragged_decode(q, k, v, tables, kv))
    args = (q, k, v)
for _ in range(3):
    f(*args).block_until_ready()
print("done", dtype)
