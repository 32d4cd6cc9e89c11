"""packed_inputs: a step's integer inputs in one array and back, exactly, for decode and prefill buckets of one
and several instances; the program's unpack (traced) gives what the host arrays held."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.contract import StepKind
from jaxllm.executor.packed_inputs import PACKED_FIELDS, pack, unpack
from jaxllm.executor.step import inert_step_inputs


def _stacked(instances: int, decode: bool, tokens: int, seqs: int, width: int, seed: int):
    """Random inputs of one bucket, stacked on a leading instance axis as the executor's layout builds them."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(instances):
        one = inert_step_inputs(StepKind.DECODE if decode else StepKind.PREFILL, tokens, seqs, width)
        for name in PACKED_FIELDS + ("tokens", "top_k", "seed"):
            value = getattr(one, name)
            value[...] = rng.integers(-1, 1 << 20, value.shape, dtype=np.int32)
        rows.append(one)
    return jax.tree.map(lambda *xs: np.stack(xs), *rows)


@pytest.mark.parametrize("instances, decode, tokens, seqs, width", [
    (1, True, 8, 8, 5), (2, True, 16, 16, 1), (1, False, 64, 4, 9), (4, False, 32, 8, 3)])
def test_unpack_gives_back_what_pack_took(instances, decode, tokens, seqs, width):
    inputs = _stacked(instances, decode, tokens, seqs, width, seed=tokens + seqs)
    packed = pack(inputs)
    assert packed.packed.shape == (instances, 3 * tokens + seqs * width + 2 * seqs + 1)
    assert packed.packed.dtype == np.int32 and all(getattr(packed, name) is None for name in PACKED_FIELDS)
    for back in (unpack(packed), jax.jit(unpack)(packed)):  # on the host, and traced as the program runs it
        assert back.packed is None
        for name in PACKED_FIELDS + ("tokens", "temperature", "top_k", "top_p", "seed"):
            np.testing.assert_array_equal(np.asarray(getattr(back, name)), getattr(inputs, name), err_msg=name)


def test_inputs_not_packed_pass_through_unpack():
    inputs = _stacked(1, True, 8, 8, 2, seed=0)
    assert unpack(inputs) is inputs


def test_pack_refuses_what_it_cannot_carry():
    inputs = _stacked(1, True, 8, 8, 2, seed=0)
    with pytest.raises(ValueError, match="kv_lens must be an int32 host array"):
        pack(dataclasses.replace(inputs, kv_lens=inputs.kv_lens.astype(np.int64)))
    with pytest.raises(ValueError, match="positions must be an int32 host array"):
        pack(dataclasses.replace(inputs, positions=jnp.asarray(inputs.positions)))
