"""Checkpoints, one module per format: HuggingFace safetensors (hf_safetensors), jaxllm's Orbax
(orbax), the HF tensor-name map (layout), and `load_model` over both and the presets (loading).

Import from here: `from jaxllm.model.checkpoints import load_model, load_hf, save_hf, ...`.
"""

from jaxllm.model.checkpoints.common import MODEL_DTYPES, CheckpointError, param_arrays, resolve_dtype
from jaxllm.model.checkpoints.hf_safetensors import SafetensorsCheckpoint, load_hf, read_hf_config, save_hf
from jaxllm.model.checkpoints.loading import load_model
from jaxllm.model.checkpoints.orbax import load_orbax, save_orbax

__all__ = ["MODEL_DTYPES", "CheckpointError", "SafetensorsCheckpoint", "load_hf", "load_model", "load_orbax",
           "param_arrays", "read_hf_config", "resolve_dtype", "save_hf", "save_orbax"]
