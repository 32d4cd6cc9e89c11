"""Multi-process start-up and process 0's hand-over of each step's inputs, through JAX itself.

Every process runs the same program (docs/ARCHITECTURE.md, decision 7). Process 0 schedules; before each
step it sends the step's inputs (a pytree of NumPy arrays) to the others with
`multihost_utils.broadcast_one_to_all`, a collective over all devices: no home-made RPC. A step's
shapes come from a few buckets, so the inputs' layout (tree structure, shapes, dtypes) is sent only
when it changes; a steady decode loop costs two broadcasts a step (an 8-byte header and the arrays).
The broadcast sums over processes in JAX, so leaves travel as 8-, 16- or 32-bit numbers (bool as uint8;
64-bit ones are refused unless jax_enable_x64 is on, as JAX would silently narrow them).
When process 0 shuts down it sends a stop, and the others' `receive` returns None.
"""

from __future__ import annotations

import os
import pickle

import jax
import numpy as np

_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
_ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
_ENV_PROCESS_ID = "JAX_PROCESS_ID"

# Header words: what follows (data / stop) and the byte length of a new layout (0: unchanged).
_DATA, _STOP = 0, 1


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_device_ids: list[int] | None = None) -> bool:
    """Join a multi-process run (`jax.distributed.initialize`); returns whether one was joined.

    Each argument left None is read from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
    With no coordinator and at most one process this is a single-process run: nothing is done. Must be
    called before anything touches a device. CPU devices exchange collectives through gloo (the CPU
    client has no other cross-process transport); GPUs use NCCL whatever this sets.
    """
    coordinator = coordinator or os.environ.get(_ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(_ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(_ENV_PROCESS_ID)
    if coordinator is None and (num_processes or 1) <= 1:
        return False
    if coordinator is None or num_processes is None or process_id is None:
        raise ValueError(f"a multi-process run needs a coordinator (HOST:PORT), num_processes and process_id; got "
                         f"coordinator={coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator {coordinator!r} is not HOST:PORT")
    if num_processes <= 0:
        raise ValueError(f"num_processes must be positive, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is outside [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)
    return True


def is_leader() -> bool:
    """Process 0: the one that schedules, serves and sends every step's inputs."""
    return jax.process_index() == 0


def _wire(x: np.ndarray) -> np.ndarray:
    """How a leaf travels: the broadcast adds the processes' copies (all zero but the source's), and
    JAX adds booleans as integers."""
    return x.astype(np.uint8) if x.dtype == np.bool_ else x


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=is_leader())


class StepBroadcast:
    """Process 0's `send(inputs)` / `stop()` paired with every other process's `receive()`, in lock step.

    inputs: any pytree of arrays whose node types every process can import (the step's inputs
    dataclass). Each send must be matched by one receive on every other process.
    """

    def __init__(self):
        self._layout: bytes | None = None  # the last layout sent / received (pickled treedef, shapes, dtypes)
        self._treedef = None
        self._shapes: list[tuple[tuple[int, ...], np.dtype]] = []

    def _header(self, kind: int, layout_bytes: int) -> tuple[int, int]:
        header = _broadcast(np.array([kind, layout_bytes], np.int32))
        return int(header[0]), int(header[1])

    def _set_layout(self, layout: bytes) -> None:
        self._layout = layout
        self._treedef, self._shapes = pickle.loads(layout)

    def send(self, inputs) -> None:
        """Process 0: hand `inputs` to every process (the caller keeps using its own copy)."""
        if not is_leader():
            raise ValueError(f"StepBroadcast.send runs on process 0 only (this is process {jax.process_index()})")
        leaves, treedef = jax.tree.flatten(inputs)
        leaves = [np.asarray(x) for x in leaves]
        for x in leaves:
            if x.dtype.itemsize > 4 and not jax.config.jax_enable_x64:
                raise ValueError(f"step input of dtype {x.dtype} {x.shape}: 64-bit leaves would be narrowed by the "
                                 "broadcast; send 32-bit arrays")
        layout = pickle.dumps((treedef, [(x.shape, x.dtype.str) for x in leaves]))
        changed = layout != self._layout
        self._header(_DATA, len(layout) if changed else 0)
        if changed:
            _broadcast(np.frombuffer(layout, np.uint8))
            self._set_layout(layout)
        _broadcast([_wire(x) for x in leaves])

    def stop(self) -> None:
        """Process 0: tell the others there are no more steps."""
        if not is_leader():
            raise ValueError(f"StepBroadcast.stop runs on process 0 only (this is process {jax.process_index()})")
        self._header(_STOP, 0)

    def receive(self):
        """Other processes: the next inputs process 0 sent (NumPy leaves), or None once it stopped."""
        if is_leader():
            raise ValueError("StepBroadcast.receive runs on processes other than 0")
        kind, layout_bytes = self._header(_DATA, 0)
        if kind == _STOP:
            return None
        if layout_bytes:
            layout = _broadcast(np.zeros(layout_bytes, np.uint8))
            self._set_layout(np.asarray(layout, np.uint8).tobytes())
        placeholders = [_wire(np.zeros(shape, np.dtype(dtype))) for shape, dtype in self._shapes]
        leaves = _broadcast(placeholders)
        return jax.tree.unflatten(self._treedef, [np.asarray(x).astype(np.dtype(dtype))
                                                  for x, (_, dtype) in zip(leaves, self._shapes)])
