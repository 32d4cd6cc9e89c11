"""Every difference between the JAX versions we run on (0.10.2 on CPU, 0.11.2 on the GPU machine).

Nothing else in the project may branch on the JAX version: add a function here instead.
"""

from __future__ import annotations

import functools
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


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of device 0 when it is a CUDA GPU, else None."""
    if not on_gpu():
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)
