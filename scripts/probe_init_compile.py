"""Probe (issue 32): how long init_model's sharded random draw takes to compile, the whole model as one program
(the draw before session 23) against the by-layer programs (a layer's, then the embedding / norms / head), on
4 CPU host devices, compile only (nothing drawn: the 70B shape does not fit in this machine's memory); and how
long init_model takes for the tiny preset at TP 2, the first time and again in the same process.

  PYTHONPATH=$PWD python3 scripts/probe_init_compile.py
"""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from common import harness
    from jaxllm.model import llama
    from jaxllm.model.config import LlamaConfig, preset
    from sharding.mesh import make_mesh
    from sharding.rules import load_sharding

    result = {"devices": 4, "device": "cpu", "what": __doc__.split("\n\n")[0], "rows": []}
    for name in ("llama2-13b", "llama2-70b"):
        config = preset(name)
        sharding = load_sharding(config, make_mesh(4))

        def make():
            return llama.Llama(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(params=0))

        _, abstract = nnx.split(nnx.eval_shape(make))
        where = jax.tree_util.tree_map_with_path(lambda p, x: sharding(llama._state_path(p), tuple(x.shape)), abstract)
        start = time.perf_counter()
        jax.jit(lambda: nnx.split(make())[1], out_shardings=where).lower().compile()
        whole = time.perf_counter() - start
        pure = nnx.to_pure_dict(where)
        start = time.perf_counter()
        llama._layer_program(config, jnp.bfloat16, 0, *llama._flat(pure["layers"][0])).lower(1).compile()
        ends = {k: v for k, v in pure.items() if k != "layers"}
        llama._ends_program(config, jnp.bfloat16, 0, *llama._flat(ends)).lower(1).compile()
        by_layer = time.perf_counter() - start
        result["rows"].append(dict(model=name, layers=config.num_layers, whole_model_compile_s=whole,
                                   by_layer_compile_s=by_layer))
        print(f"{name}: whole model {whole:.1f} s, by layer {by_layer:.1f} s to compile", flush=True)
    tiny = LlamaConfig.tiny()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        llama.init_model(tiny, seed=0, sharding=load_sharding(tiny, make_mesh(2)))
        times.append(time.perf_counter() - start)
    result["tiny_tp2_init_s"] = {"first": times[0], "again": times[1]}
    print(f"tiny at TP 2: init_model {times[0]:.2f} s, again {times[1]:.2f} s", flush=True)
    path = os.path.join(harness.RESULTS_DIR, harness.result_stem("cpu", "probe-init-compile") + ".json")
    harness.write_json(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
