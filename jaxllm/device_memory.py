"""Bytes free on a device for the KV pool: the allocator's own count, or the CUDA driver's where the allocator
keeps none.

XLA's BFC allocator (JAX's default) reports `bytes_limit` and `bytes_in_use` through `Device.memory_stats()`.
XLA's VMM allocator, which the tensor-parallel flags select (sharding.xla_flags: the command-buffer update mode
needs it), reports nothing (`memory_stats()` is None). There the driver's count stands in: what is free on the
device, but no more than JAX's memory fraction (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75) of it less what is
already used, since that fraction is what the allocator was told it may take.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["device_free_bytes"]

_DEFAULT_MEM_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION


def device_free_bytes(devices) -> int | None:
    """Bytes free on the fullest of `devices`; None where neither the allocator nor the driver counts them (a CPU
    host)."""
    stats = [d.memory_stats() for d in devices]
    if stats and all(s and "bytes_limit" in s for s in stats):
        return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    if not devices or any(d.platform != "gpu" for d in devices):
        return None
    counts = [_driver_free_and_total(d.local_hardware_id) for d in devices]
    if any(c is None for c in counts):
        return None
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", _DEFAULT_MEM_FRACTION))
    return min(min(free, int(fraction * total) - (total - free)) for free, total in counts)


def _driver_free_and_total(ordinal: int | None) -> tuple[int, int] | None:
    """(free, total) bytes of CUDA device `ordinal` from the driver (cuMemGetInfo in the device's primary
    context, the one XLA uses); None where the driver cannot be asked."""
    if ordinal is None:
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, context = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal):
        return None
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(context):
            return None
        try:
            if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
                return None
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)
    return free.value, total.value
