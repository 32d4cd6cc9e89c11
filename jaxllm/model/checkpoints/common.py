"""What every checkpoint format shares: the error type, dtypes, and building a model from loaded Params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import Llama, abstract_model
from jaxllm.model.rope import inverse_frequencies

MODEL_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# Copied beside a converted checkpoint so it stays usable on its own.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not fit its config."""


def resolve_dtype(dtype) -> jnp.dtype | None:
    """None, 'float32' / 'bfloat16' / 'float16' (or bf16/fp16/fp32), or a dtype -> a model dtype (or None)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if name not in MODEL_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(MODEL_DTYPES)}")
        return jnp.dtype(MODEL_DTYPES[name])
    try:
        resolved = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype {dtype!r} is not a dtype; use one of {sorted(MODEL_DTYPES)}") from e
    if resolved.name not in MODEL_DTYPES:
        raise ValueError(f"dtype {resolved.name!r} is not supported; use one of {sorted(MODEL_DTYPES)}")
    return resolved


def variable_value(variable: nnx.Variable) -> jax.Array:
    """A Variable's array: get_value() in newer Flax, .value in older releases (deprecated in newer ones)."""
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def assemble(config: LlamaConfig, dtype, load_one) -> Llama:
    """A Llama whose every Param comes from load_one(path, shape, dtype) and whose inv_freq is computed."""
    graphdef, params, rest = nnx.split(abstract_model(config, dtype=dtype), nnx.Param, ...)
    values = {}
    for path, variable in nnx.to_flat_state(params):
        target = variable_value(variable)
        values[path] = load_one(path, tuple(target.shape), target.dtype)
    rest_values = {}
    for path, _ in nnx.to_flat_state(rest):
        if path != ("inv_freq",):  # a new non-Param variable needs a rule here, not a silent zero
            raise NotImplementedError(f"no rule to compute model variable {'.'.join(map(str, path))}")
        rest_values[path] = jnp.asarray(inverse_frequencies(config), jnp.float32)
    nnx.replace_by_pure_dict(params, _unflatten(values))
    nnx.replace_by_pure_dict(rest, _unflatten(rest_values))
    return nnx.merge(graphdef, params, rest)


def _unflatten(flat: dict[tuple, object]) -> dict:
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return nested


def param_arrays(model: Llama) -> dict[tuple, jax.Array]:
    """Every Param of the model by its nnx path, e.g. ("layers", 0, "attention", "qkv") -> [D, Hkv, G + 2, hd]."""
    params = nnx.state(model, nnx.Param)
    return {path: variable_value(v) for path, v in nnx.to_flat_state(params)}


def model_dtype(arrays: dict[tuple, jax.Array]) -> jnp.dtype:
    """The model's dtype, from param_arrays' result."""
    return jnp.dtype(arrays[("embedding",)].dtype)
