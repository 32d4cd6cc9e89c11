"""Probe (issue 35): does a device_put to pinned_host pay for growing XLA's pinned host allocator, and is the memory
reused once freed? Prints JSON lines. One GPU."""
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
dev = jax.devices()[0]
host = SingleDeviceSharding(dev, memory_kind="pinned_host")
x = jnp.ones((1 << 29,), jnp.bfloat16)  # 1 GiB
x.block_until_ready()


def puts(count):
    held, times = [], []
    for _ in range(count):
        t = time.perf_counter()
        y = jax.device_put(x, host)
        t1 = time.perf_counter()
        y.block_until_ready()
        times.append((t1 - t, time.perf_counter() - t))
        held.append(y)
    return held, times


for name in ("grow", "reuse", "reuse2"):
    held, times = puts(n)
    call = [a for a, _ in times]
    total = [b for _, b in times]
    print(json.dumps(dict(phase=name, gib=n, call_s_sum=sum(call), total_s_sum=sum(total),
                          first5=[round(b, 4) for b in total[:5]], last5=[round(b, 4) for b in total[-5:]],
                          gb_s=n * 1.073741824 / sum(total))), flush=True)
    del held
# Past the default limit (64 GiB): where does it fail, and how?
held = []
try:
    for i in range(80):
        held.append(jax.device_put(x, host))
        held[-1].block_until_ready()
    print(json.dumps(dict(phase="limit", held_gib=len(held), error=None)), flush=True)
except Exception as e:  # noqa: BLE001
    print(json.dumps(dict(phase="limit", held_gib=len(held), error=str(e)[:300])), flush=True)
