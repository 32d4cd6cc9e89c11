"""One process of the 2-process test (test_multihost.py starts it through scripts/launch.py).

Process 0 sends three step-input pytrees on the step channel (the second with new shapes, the third the first's
again) and a stop; the others check they arrive identical, in order. Then every process takes part in column-
and row-parallel matmuls over all global devices, checked against NumPy. Prints "worker <id> of <count> ok" on
success; any failure exits non-zero. With no flags it joins the run its environment names (JAX_* variables, or a
cluster launcher's: test_multihost.py feeds it Open MPI's).
"""

import argparse

import numpy as np


def _inputs(step: int) -> dict:
    rng = np.random.default_rng(step)
    n = 4 + 4 * step  # the second step has new shapes: the layout is sent again
    return {"tokens": rng.integers(0, 1000, n).astype(np.int32), "positions": np.arange(n, dtype=np.int32),
            "tables": rng.integers(0, 64, (2, 3)).astype(np.int32), "decode": np.array(step % 2 == 1),
            "sampling": (rng.random(2).astype(np.float32), np.zeros(2, np.uint8))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()

    from sharding import multihost

    assert multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from sharding.mesh import TENSOR, make_mesh

    assert jax.process_count() == (args.num_processes or jax.process_count()) > 1
    assert jax.device_count() == 2 * jax.process_count()

    channel = multihost.step_channel()
    for step in range(3):
        if multihost.is_leader():
            channel.send(_inputs(step % 2))
        else:
            got = channel.receive()
            want = _inputs(step % 2)
            assert jax.tree.structure(got) == jax.tree.structure(want), (got, want)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (a, b)
    if multihost.is_leader():
        assert channel.stop() == []  # every follower took every message
    else:
        assert channel.receive() is None

    mesh = make_mesh(jax.device_count())
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 32), np.float32)

    def global_array(a, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    want = x @ w
    whole = NamedSharding(mesh, P())
    for x_spec, w_spec in ((P(), P(None, TENSOR)), (P(None, TENSOR), P(TENSOR, None))):  # column-, row-parallel
        xg, wg = global_array(x, x_spec), global_array(w, w_spec)
        assert len({s.device for s in wg.addressable_shards}) == jax.local_device_count()
        y = jax.jit(jnp.dot, out_shardings=whole)(xg, wg)
        got = np.asarray(y.addressable_data(0))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"worker {jax.process_index()} of {jax.process_count()} ok", flush=True)


if __name__ == "__main__":
    main()
