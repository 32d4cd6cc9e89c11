"""jaxllm: long-context Llama-2 inference in JAX over ragged, distributed rBlock attention.

Public names load lazily, so `import jaxllm.model.config` (or `--help` of a command) stays cheap.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxllm.llm", "Completion": "jaxllm.llm", "EngineOptions": "jaxllm.engine_config",
    "EngineConfig": "jaxllm.engine_config", "build_engine": "jaxllm.builder",
    "LlamaConfig": "jaxllm.model.config", "RopeScaling": "jaxllm.model.config", "preset": "jaxllm.model.config",
    "SamplingParams": "jaxllm.contract", "EngineStats": "jaxllm.contract",
    "add_tensor_parallel_flags": "sharding.xla_flags",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
