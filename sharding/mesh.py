"""The device mesh: axes `instance` (independent serving instances) and `tensor` (tensor parallelism).

One SPMD program runs over the whole mesh (docs/ARCHITECTURE.md, decision 7). The tensor axis is the
inner (fastest-varying) one, so a tensor-parallel group is N consecutive devices: `jax.devices()` lists
each process's devices together, so a group stays inside one host (NVLink) whenever N <= the devices a
host has, and only the instance axis crosses hosts.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

INSTANCE = "instance"
TENSOR = "tensor"
AXES = (INSTANCE, TENSOR)


def check_tensor_parallel(config, tensor_parallel: int) -> None:
    """Raise ValueError unless a model of `config` can be split `tensor_parallel` ways.

    config: anything with num_heads, num_kv_heads and intermediate_size (a LlamaConfig). Each device
    takes whole query heads and whole columns of the MLP; KV heads are split when there are at least as
    many as devices, and replicated (each held by tensor_parallel / num_kv_heads devices) when there are
    fewer, which needs that ratio to be whole (see rules.kv_head_replication).
    """
    n = tensor_parallel
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"tensor_parallel must be a positive integer, got {n!r}")
    if config.num_heads % n:
        raise ValueError(f"tensor_parallel {n} does not divide the model's {config.num_heads} query heads")
    kv = config.num_kv_heads
    if (kv % n) if n <= kv else (n % kv):
        raise ValueError(f"tensor_parallel {n} and the model's {kv} KV heads: one must divide the other "
                         "(KV heads are split, or replicated when fewer than the devices)")
    if config.intermediate_size % n:
        raise ValueError(f"tensor_parallel {n} does not divide the MLP width intermediate_size "
                         f"{config.intermediate_size}")


def make_mesh(tensor_parallel: int, instances: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of shape [instances, tensor_parallel] over the first instances x tensor_parallel devices.

    devices: defaults to `jax.devices()`, every process's devices (all hosts, after
    multihost.initialize), in JAX's order.
    """
    for name, value in (("tensor_parallel", tensor_parallel), ("instances", instances)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    devices = list(jax.devices() if devices is None else devices)
    needed = tensor_parallel * instances
    if len(devices) < needed:
        raise ValueError(f"a mesh of {instances} instance(s) x tensor parallel {tensor_parallel} needs {needed} "
                         f"devices; only {len(devices)} are available")
    grid = np.array(devices[:needed], dtype=object).reshape(instances, tensor_parallel)
    return Mesh(grid, AXES)


def tensor_size(mesh: Mesh) -> int:
    """How many ways the mesh splits a model (1 for a mesh without a tensor axis)."""
    return int(mesh.shape.get(TENSOR, 1))


def instance_hosts(mesh: Mesh) -> list[int]:
    """The host (process index) of each instance on the mesh: lending prefers a creditor on the same host."""
    return [int(row[0].process_index) for row in np.asarray(mesh.devices).reshape(int(mesh.shape[INSTANCE]), -1)]
