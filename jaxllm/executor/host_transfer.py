"""The one seam between the host tier's store and the way runs of rBlocks cross the host link.

`HostTransfer.to_host` starts copying a compact run of rBlocks (a KVCache-shaped pytree [run, ...] on the
devices) to host memory and returns at once with a `HostRun`; `to_device` starts copying one back. Neither waits:
copies overlap the steps. `HostRun.wait()` returns once the run has landed on the host; a reader calls it before
`arrays()`, whose contents are undefined until then.

`AsyncHostTransfer` is the real one: `jax.device_put` to the devices' host memory kind ("pinned_host" where the
backend has it: the GPU copies it by DMA, asynchronously), whose arrays JAX itself orders (a copy back to the
devices starts after the copy out landed), so its `wait()` returns at once and nothing blocks the launcher
thread. Where a backend lists no host memory kind it falls back to NumPy arrays (`copy_to_host_async` now, the
read at `wait()`). Tests put a slower transfer here to check that nothing reads a run before it lands.

On several instances a run is whole on every instance's devices; its host copy is made once, from the copy on
the devices of the instance whose host tier keeps it (a view of those buffers, no device copy), into their host
memory; a copy back goes to those devices, then to every instance's.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pallas_kernels import compat

__all__ = ["AsyncHostTransfer", "HostRun", "HostTransfer"]


class HostRun(Protocol):
    """A run of rBlocks copied (or being copied) to the host."""

    def wait(self) -> None:
        """Return once the run has landed on the host."""
        ...

    def arrays(self):
        """The run's host arrays (KVCache-shaped, [run, ...] leaves); defined once wait() returned."""
        ...


class HostTransfer(Protocol):
    """Starts copies of runs of rBlocks between the devices and the host; never waits for them."""

    def to_host(self, run, instance: int = 0) -> HostRun:
        """Start copying `run` (device arrays, [run, ...] leaves) to the host of instance `instance`."""
        ...

    def to_device(self, run: HostRun):
        """Start copying a landed host run back; its device arrays (placed as the pool's rBlocks are)."""
        ...


class _PlacedRun:
    """A run in a host memory kind: JAX orders every later copy of it after it lands."""

    def __init__(self, arrays):
        self._arrays = arrays

    def wait(self) -> None:
        return None  # a device_put of these arrays waits for them on its own, without blocking this thread

    def arrays(self):
        return self._arrays


class _NumpyRun:
    """A run read into NumPy arrays (backends without a host memory kind): the read happens at wait()."""

    def __init__(self, device_arrays):
        for leaf in jax.tree.leaves(device_arrays):
            leaf.copy_to_host_async()
        self._device, self._host = device_arrays, None

    def wait(self) -> None:
        if self._host is None:
            self._host, self._device = jax.tree.map(np.asarray, self._device), None

    def arrays(self):
        return self._host


class AsyncHostTransfer:
    """The HostTransfer of a device pool (see the module docstring). device_shardings: a run's NamedShardings on the
    mesh (the pool's, without the instance split); instances: the mesh's first axis, each instance's host tier
    kept in the host memory of its own devices."""

    def __init__(self, device_shardings, *, instances: int = 1):
        self.device_shardings = device_shardings
        self.instances = instances
        first = jax.tree.leaves(device_shardings)[0]
        self.memory_kind = compat.host_memory_kind(next(iter(first.device_set)))
        # Per instance: a run's shardings on that instance's devices alone (the whole mesh when it has one).
        self.instance_shardings = [device_shardings]
        if instances > 1:
            mesh = first.mesh
            subs = [Mesh(mesh.devices[i:i + 1], mesh.axis_names) for i in range(instances)]
            self.instance_shardings = [jax.tree.map(lambda s, sub=sub: NamedSharding(sub, s.spec), device_shardings)
                                       for sub in subs]
        self.host_shardings = None if self.memory_kind is None else [
            jax.tree.map(lambda s: s.with_memory_kind(self.memory_kind), shardings)
            for shardings in self.instance_shardings]

    def to_host(self, run, instance: int = 0) -> HostRun:
        if self.instances > 1:
            run = jax.tree.map(_on_devices, run, self.instance_shardings[instance])
        if self.host_shardings is None:
            return _NumpyRun(run)
        return _PlacedRun(jax.device_put(run, self.host_shardings[instance]))

    def to_device(self, run: HostRun):
        arrays = run.arrays()
        if self.instances > 1 and self.memory_kind is not None:
            # Onto its own instance's devices first (only the memory kind changes), then onto every instance's.
            arrays = jax.device_put(arrays, jax.tree.map(lambda x: NamedSharding(x.sharding.mesh, x.sharding.spec),
                                                         arrays))
        return jax.device_put(arrays, self.device_shardings)


def _on_devices(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """x (whole on every instance) as the copy on `sharding`'s devices alone: a view of those buffers."""
    devices = sharding.device_set
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [shard.data for shard in x.addressable_shards if shard.device in devices])
