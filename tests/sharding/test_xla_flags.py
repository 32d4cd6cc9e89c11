"""The tensor-parallel XLA flags: added to XLA_FLAGS only for tensor parallelism on a CUDA backend, never over a
flag the user set."""

from __future__ import annotations

import warnings

import pytest

from sharding.xla_flags import (OPT_OUT_ENV, TENSOR_PARALLEL_XLA_FLAGS, add_tensor_parallel_flags,
                                cuda_backend_expected, tensor_parallel_flags_missing,
                                warn_without_tensor_parallel_flags)


def test_tensor_parallel_on_cuda_appends_every_flag_after_the_users():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/dump"}
    added = add_tensor_parallel_flags(4, environ, cuda=True)
    assert added == list(TENSOR_PARALLEL_XLA_FLAGS)
    assert environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/dump", *TENSOR_PARALLEL_XLA_FLAGS]
    assert add_tensor_parallel_flags(4, environ, cuda=True) == []  # a second call adds nothing
    assert tensor_parallel_flags_missing(environ) == []


def test_a_flag_the_user_named_is_left_as_set():
    environ = {"XLA_FLAGS": "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"}
    added = add_tensor_parallel_flags(2, environ, cuda=True)
    assert "--xla_gpu_command_buffer_update_mode=SKIP_TEMP" not in added
    assert len(added) == len(TENSOR_PARALLEL_XLA_FLAGS) - 1
    assert environ["XLA_FLAGS"].split()[0] == "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"
    assert "SKIP_TEMP" not in environ["XLA_FLAGS"]


def test_nothing_is_added_for_one_device_without_cuda_or_with_the_host_tier():
    for tp, cuda, host_tier in ((1, True, False), (4, False, False), (4, True, True)):
        environ: dict[str, str] = {}
        assert add_tensor_parallel_flags(tp, environ, host_tier=host_tier, cuda=cuda) == []
        assert environ == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_without_tensor_parallel_flags(4, {}, host_tier=True)  # the host tier runs without them: no warning


def test_jax_platforms_without_cuda_expects_no_cuda_backend():
    assert not cuda_backend_expected({"JAX_PLATFORMS": "cpu"})
    # This machine (CI's, the sandbox's) has no CUDA plugin: no CUDA backend whatever JAX_PLATFORMS says.
    assert not cuda_backend_expected({"JAX_PLATFORMS": "cuda"})


def test_an_engine_without_the_flags_is_warned_with_the_missing_ones_named():
    environ = {"XLA_FLAGS": "--xla_gpu_graph_min_graph_size=1"}
    with pytest.warns(RuntimeWarning, match=r"add_tensor_parallel_flags\(4\)") as caught:
        warn_without_tensor_parallel_flags(4, environ)
    (message,) = [str(w.message) for w in caught]
    assert "--xla_gpu_command_buffer_update_mode=SKIP_TEMP" in message
    assert "--xla_gpu_graph_min_graph_size" not in message  # set already
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_without_tensor_parallel_flags(1, {})  # one device: nothing to say
        add_tensor_parallel_flags(4, environ, cuda=True)
        warn_without_tensor_parallel_flags(4, environ)  # every flag set: nothing to say


def test_the_environment_opts_out_of_every_flag_and_of_the_warning():
    for value in ("0", "false", "Off"):
        environ = {OPT_OUT_ENV: value}
        assert add_tensor_parallel_flags(4, environ, cuda=True) == []
        assert "XLA_FLAGS" not in environ
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_without_tensor_parallel_flags(4, environ)
    assert add_tensor_parallel_flags(4, {OPT_OUT_ENV: "1"}, cuda=True) == list(TENSOR_PARALLEL_XLA_FLAGS)
