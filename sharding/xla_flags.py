"""XLA settings for a tensor-parallel step, which must be in XLA_FLAGS before JAX starts its GPU backend.

A tensor-parallel decode step is short and host-bound: XLA runs it as CUDA graphs (command buffers), and with its
defaults it cuts them at each of the step's all-reduces (two a layer, run as XLA's one-shot all-reduce kernel
outside the graphs), so every step launches and updates ~80 graph pieces a device. These flags put NCCL's
all-reduce inside the command buffer, so the step is one graph a device, and keep the step's temporary buffers at
fixed addresses (XLA's VMM allocator, update mode SKIP_TEMP), which makes updating that graph each step cheap enough
to pay (NCCL in one graph without SKIP_TEMP was slower than the defaults). Measured on 4 x H200, 13B at 4K, batch 1
(BENCHMARKS.md, issue 32): the jitted step back to back, TP 4 6.78 -> 5.19 ms and TP 2 6.29 -> 5.82 ms, the same
tokens. A one-device step is not host-bound; the entry points set them only for tensor_parallel > 1.

The VMM allocator reports no memory counts (jaxllm.device_memory asks the CUDA driver instead) and has no pinned
host memory, so the entry points leave the flags out when the host KV tier is on.

XLA reads XLA_FLAGS once, when the backend starts (the first thing that touches a device), so the entry points
call `add_tensor_parallel_flags` right after parsing their arguments; a program that builds `LLM` itself calls it
before its first JAX call, or sets the flags in XLA_FLAGS itself. A flag the environment already names is left as
it is (the user's choice wins); JAXLLM_TENSOR_PARALLEL_XLA_FLAGS=0 adds none (XLA's defaults); on a machine with no
CUDA plugin nothing is added (the CPU backend of an older jaxlib may not know them, and XLA rejects an unknown
flag).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import MutableMapping

__all__ = ["OPT_OUT_ENV", "TENSOR_PARALLEL_XLA_FLAGS", "add_tensor_parallel_flags", "cuda_backend_expected",
           "tensor_parallel_flags_missing", "warn_without_tensor_parallel_flags"]

TENSOR_PARALLEL_XLA_FLAGS: tuple[str, ...] = (
    "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES",
    "--xla_gpu_graph_min_graph_size=1",
    "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false",
)

# Set to 0 (or false / no / off): the entry points add none of the flags (XLA's defaults, its BFC allocator).
OPT_OUT_ENV = "JAXLLM_TENSOR_PARALLEL_XLA_FLAGS"
_NO = ("0", "false", "no", "off")

# The modules of jax's CUDA plugin packages (jax-cuda1N-plugin, jax-cuda1N-pjrt).
_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def _opted_out(environ: MutableMapping[str, str]) -> bool:
    return environ.get(OPT_OUT_ENV, "").strip().lower() in _NO


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def cuda_backend_expected(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether JAX will start a CUDA backend: a CUDA plugin is installed and JAX_PLATFORMS (if set) allows it.
    Decided without starting a backend (starting one would fix XLA_FLAGS)."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(name in platforms for name in ("cuda", "gpu")):
        return False
    return any(_installed(name) for name in _CUDA_PLUGINS)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose package is absent
        return False


def tensor_parallel_flags_missing(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """The flags of TENSOR_PARALLEL_XLA_FLAGS whose names XLA_FLAGS does not mention."""
    present = {_flag_name(word) for word in environ.get("XLA_FLAGS", "").split()}
    return [flag for flag in TENSOR_PARALLEL_XLA_FLAGS if _flag_name(flag) not in present]


def _wanted(tensor_parallel: int, host_tier: bool, environ: MutableMapping[str, str]) -> bool:
    """Whether a run wants the flags: tensor parallel, no host tier (the VMM allocator has no pinned host memory),
    not opted out."""
    return tensor_parallel > 1 and not host_tier and not _opted_out(environ)


def add_tensor_parallel_flags(tensor_parallel: int, environ: MutableMapping[str, str] = os.environ,
                              *, host_tier: bool = False, cuda: bool | None = None) -> list[str]:
    """Append to environ["XLA_FLAGS"] the tensor-parallel flags it does not name, when tensor_parallel > 1, no
    host KV tier is asked for (`host_tier`), the environment does not opt out (OPT_OUT_ENV=0) and a CUDA backend
    is expected (`cuda`: None asks cuda_backend_expected); the flags added. Effective only before JAX's backend
    starts."""
    if not _wanted(tensor_parallel, host_tier, environ):
        return []
    if not (cuda_backend_expected(environ) if cuda is None else cuda):
        return []
    missing = tensor_parallel_flags_missing(environ)
    if missing:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", "").strip(), *missing]).strip()
    return missing


def warn_without_tensor_parallel_flags(tensor_parallel: int, environ: MutableMapping[str, str] = os.environ, *,
                                       host_tier: bool = False) -> None:
    """A RuntimeWarning naming the flags XLA_FLAGS lacks, for an engine that wants them (add_tensor_parallel_flags'
    rule) built on a running GPU backend (too late to add them: XLA read its flags when the backend started)."""
    missing = tensor_parallel_flags_missing(environ) if _wanted(tensor_parallel, host_tier, environ) else []
    if missing:
        warnings.warn(f"tensor_parallel {tensor_parallel} runs its decode step slower without the XLA flags that "
                      f"make it one CUDA graph a device: call jaxllm.add_tensor_parallel_flags({tensor_parallel}) "
                      f"before anything starts JAX's backend, or add to XLA_FLAGS: {' '.join(missing)}",
                      RuntimeWarning, stacklevel=3)
