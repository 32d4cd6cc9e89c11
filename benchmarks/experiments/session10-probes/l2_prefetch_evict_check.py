import jax, jax.numpy as jnp
from pallas_kernels import rms_norm, l2_prefetch, compat
print("evict name", compat._evict_last_name())
x = jax.random.normal(jax.random.key(0), (1, 4096), jnp.bfloat16)
d = jax.random.normal(jax.random.key(1), (3, 1, 4096), jnp.float32)
w = jax.random.normal(jax.random.key(2), (4096,), jnp.bfloat16)
W = jax.random.normal(jax.random.key(3), (4096, 12288), jnp.bfloat16)
plan = l2_prefetch.matmul_bands(4096, 12288, jnp.bfloat16, split_rows=2048, max_bytes=8<<20, programs=512)
a = rms_norm.add_rms_norm(x, d, w, eps=1e-5)
b = rms_norm.add_rms_norm(x, d, w, eps=1e-5, l2_prefetch=(W, plan))
print("equal", [bool((u == v).all()) for u, v in zip(a, b)])
