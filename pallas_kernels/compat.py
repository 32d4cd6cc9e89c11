"""Every difference between the JAX versions we run on (0.10.2 on CPU, 0.11.2 on the GPU machine).

Nothing else in the project may branch on the JAX version: add a function here instead.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def is_tracer(x) -> bool:
    """True for abstract values under jit/vmap, where data-dependent checks cannot run."""
    return isinstance(x, jax.core.Tracer)


@functools.cache
def triton_compiler_params_cls():
    """The Triton-lowering CompilerParams class (its import path moved between releases)."""
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams


def triton_compiler_params(num_warps: int, num_stages: int):
    return triton_compiler_params_cls()(num_warps=num_warps, num_stages=num_stages)


def silence_triton_deprecation() -> None:
    """From 0.11 the Pallas Triton backend warns on every call that it is deprecated; we know."""
    warnings.filterwarnings("ignore", message=r".*[Tt]riton.*deprecat.*")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def default_interpret(interpret: bool | None) -> bool:
    """A kernel's `interpret` argument: None means the Pallas interpreter unless on a GPU."""
    return not on_gpu() if interpret is None else bool(interpret)


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of device 0 when it is a CUDA GPU, else None."""
    if not on_gpu():
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def triton_masked_store(ref, value, mask) -> None:
    """Store `value` into a Triton-lowered Pallas ref where `mask` holds (the rest is left untouched)."""
    from jax.experimental.pallas import triton as pl_triton

    pl_triton.store(ref, value, mask=mask)


def mgpu_interpret_params(**kwargs):
    """Mosaic GPU interpret-mode parameters (a private class in 0.10.2), or None where this JAX has none.

    `plgpu.kernel(..., interpret=params)` then simulates warpgroups, barriers and TMA on the CPU.
    """
    for module in ("jax.experimental.pallas.mosaic_gpu", "jax._src.pallas.mosaic_gpu.interpret.params"):
        try:
            cls = getattr(__import__(module, fromlist=["InterpretGPUParams"]), "InterpretGPUParams")
        except (ImportError, AttributeError):
            continue
        return cls(**kwargs)
    return None


def reset_mgpu_interpret_state() -> None:
    """Mosaic GPU interpret mode keeps global state that an exception inside a kernel leaves dirty."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    except ImportError:
        return
    reset = getattr(interpret_pallas_call, "reset_gpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def triton_masked_load(ref, mask, other, *, coherent: bool = False):
    """Load a Triton-lowered Pallas ref where `mask` holds, `other` elsewhere (nothing read there).

    coherent: read past the SM's L1 (a volatile load), for data other programs of the running kernel
    wrote; an L1 line filled earlier could be stale. (cache_modifier=".cg" would do, but 0.11.2's
    lowering cannot look that name up.)
    """
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.load(ref, mask=mask, other=other, volatile=coherent)


def triton_atomic_add(ref, idx, value):
    """Atomic add (acquire-release, GPU scope) into ref[idx] of a Triton-lowered Pallas kernel; returns the old value."""
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.atomic_add(ref, idx, jnp.asarray(value, ref.dtype))


def triton_barrier(interpret: bool) -> None:
    """Block-wide barrier (bar.sync) in a Triton-lowered Pallas kernel; nothing in interpret mode, which
    runs one program at a time (and has no lowering for it)."""
    if interpret:
        return
    from jax.experimental.pallas import triton as pl_triton

    pl_triton.debug_barrier()


@functools.cache
def _mgpu_load_takes_index() -> bool:
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu

    return "idx" in inspect.signature(plgpu.load).parameters


def mgpu_load(ref, *, layout, optimized: bool = True):
    """The whole of a Mosaic GPU ref in registers with `layout`: 0.10 `plgpu.load` takes an index
    argument (`()` for all of it), 0.11 dropped it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if _mgpu_load_takes_index():
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def host_memory_kind(device) -> str | None:
    """The memory kind of `device`'s host memory that arrays can be placed in and copied to and from
    asynchronously ("pinned_host", else "unpinned_host"), or None where its backend lists neither (then host
    copies are plain NumPy arrays)."""
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    return None


# XLA's GPU client pins host memory ("pinned_host" arrays) from one allocator per client, capped at this many GiB
# unless the variable below says otherwise (read once, when the client starts): past it an allocation fails.
PINNED_HOST_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
_PINNED_HOST_DEFAULT_GB = 64


def pinned_host_limit_bytes(device) -> int | None:
    """Bytes of pinned host memory `device`'s backend can hand out in all, or None where it has no such cap (no
    "pinned_host" memory kind: the CPU)."""
    if host_memory_kind(device) != "pinned_host" or device.platform != "gpu":
        return None
    try:
        gib = int(os.environ.get(PINNED_HOST_LIMIT_VAR, _PINNED_HOST_DEFAULT_GB))
    except ValueError:
        gib = _PINNED_HOST_DEFAULT_GB  # XLA logs the bad value and keeps its default
    return gib << 30
