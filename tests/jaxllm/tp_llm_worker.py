"""Tensor parallelism through `LLM` on 8 CPU host devices, run in a subprocess by test_tensor_parallel_llm.py.

The device count must be set before jax is imported, which the shared pytest process cannot do; this
script does it, runs every case and prints one JSON line for the tests to assert on.
"""

import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.llm import LLM, EngineOptions  # noqa: E402
from jaxllm.model.checkpoints import load_model, save_hf, save_orbax  # noqa: E402
from jaxllm.model.config import LlamaConfig  # noqa: E402
from jaxllm.model.llama import init_model  # noqa: E402
from sharding import rules  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402

SMALL = dict(hidden_size=64, num_layers=2, intermediate_size=128, max_position_embeddings=256)
CONFIGS = {
    "mha": LlamaConfig(vocab_size=320, num_heads=8, num_kv_heads=8, name="mha", **SMALL),
    "gqa": LlamaConfig(vocab_size=320, num_heads=8, num_kv_heads=4, name="gqa", **SMALL),
    # 2 KV heads: TP 4 and 8 replicate them; 259 words divide by nothing, so the embedding splits on hidden
    "gqa_wide": LlamaConfig(vocab_size=259, num_heads=8, num_kv_heads=2, name="gqa_wide", **SMALL),
    # llama2-70b's head counts (64 query / 8 KV heads) at a small width
    "70b": LlamaConfig.llama2_70b(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=256,
                                  max_position_embeddings=256),
}
CASES = {"mha": (2, 4, 8), "gqa": (2, 4, 8), "gqa_wide": (2, 4, 8), "70b": (8,)}
# Generation (greedy and seeded) compiles a decode and a prefill step per LLM: run it at one tensor-parallel
# size per config (the widest, where the most is split) and check logits at every size.
GENERATE_AT = {"mha": 8, "gqa": 4, "gqa_wide": 8, "70b": 8}
PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11, 60, 61, 8, 9, 1, 4, 30, 31, 32, 33, 34], [200, 3, 7]]
GEN = dict(max_new_tokens=6, ignore_eos=True)


def _options(tp: int, **kw) -> EngineOptions:
    kw = {"num_blocks": 16, "block_size": 8, **kw}
    return EngineOptions(tensor_parallel=tp, max_seqs=4, max_tokens_per_step=32, **kw)


def _held(x) -> dict:
    """The fraction of `x` one device holds, and on how many devices it lies (from its sharding)."""
    sizes = {int(np.prod(s.data.shape)) for s in x.addressable_shards}
    return dict(fraction=max(sizes) / x.size, devices=len({s.device for s in x.addressable_shards}),
                spec=str(getattr(x.sharding, "spec", None)))


def _named(tree) -> dict:
    return {rules._path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _run(llm: LLM, generate: bool = True) -> dict:
    if not generate:
        return dict(logits=llm.logits(PROMPTS[0]))
    return dict(logits=llm.logits(PROMPTS[0]),
                greedy=[c.token_ids for c in llm.generate(PROMPTS, temperature=0.0, **GEN)],
                sampled=[c.token_ids for c in llm.generate(PROMPTS, temperature=0.9, top_k=50, seed=7, **GEN)])


def _compare(got: dict, want: dict) -> dict:
    w = want["logits"]
    out = dict(error=float(np.max(np.abs(got["logits"] - w)) / np.max(np.abs(w))), generated="greedy" in got)
    if "greedy" in got:
        out.update(greedy_equal=got["greedy"] == want["greedy"], sampled_equal=got["sampled"] == want["sampled"],
                   greedy=got["greedy"])
    return out


def main():
    out = {"device_count": jax.device_count()}
    root = tempfile.mkdtemp(prefix="jaxllm-tp-")
    for name, tps in CASES.items():
        path = os.path.join(root, name)
        save_hf(init_model(CONFIGS[name], seed=1), path)
        want = _run(LLM(path, progress=False, options=_options(1)))
        for tp in tps:
            llm = LLM(path, progress=False, options=_options(tp))
            case = _compare(_run(llm, generate=tp == GENERATE_AT[name]), want)
            info = llm.info()
            case.update(params={k: _held(v) for k, v in _named(llm.executor.state).items()},
                        pool={k: _held(v) for k, v in _named(llm.executor.kv_cache).items()},
                        devices=llm.mesh.devices.size, step_kv_heads=llm.executor.config.num_kv_heads,
                        info=dict(tensor_parallel=info.tensor_parallel, instances=info.instances,
                                  processes=info.processes, devices=info.devices, num_kv_heads=info.num_kv_heads))
            out[f"{name}/tp{tp}"] = case

    # Loading alone: each Param arrives in its shards (TP 4, KV heads split, not replicated).
    mesh = make_mesh(4)
    model, _ = load_model(os.path.join(root, "gqa"), sharding=functools.partial(rules.load_sharding, mesh=mesh))
    out["load/hf/tp4"] = {k: _held(v) for k, v in _named(_params(model)).items()}

    # Orbax, restored with the target shardings, then through LLM at TP 4 (KV heads replicated).
    orbax_dir = os.path.join(root, "gqa_wide_orbax")
    save_orbax(init_model(CONFIGS["gqa_wide"], seed=1), orbax_dir)
    want = _run(LLM(os.path.join(root, "gqa_wide"), progress=False, options=_options(1)))
    llm = LLM(orbax_dir, progress=False, options=_options(4))
    out["orbax/tp4"] = dict(_compare(_run(llm), want),
                            params={k: _held(v) for k, v in _named(llm.executor.state).items()})

    # The Pallas kernels (interpret mode) per device inside shard_map, through the runner's Kernels.
    tiny = LLM("tiny", progress=False, options=_options(1, block_size=16, num_blocks=4))
    ref = tiny.logits(PROMPTS[0][:9])
    kernels = LLM("tiny", progress=False, options=_options(2, block_size=16, num_blocks=4, attention_backend="triton"))
    got = kernels.logits(PROMPTS[0][:9])
    out["tiny/tp2/triton"] = dict(error=float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))),
                                  per_shard=kernels.runner.kernels.per_shard is not None)

    # Warm-up on a mesh compiles what serving meets, continuations (tokens from the last step's output) included.
    warm = LLM("tiny", progress=False, options=_options(2))
    warm.warm_up(progress=False)
    before = warm.compile_count
    warm.generate(["hello there", "abc"], max_new_tokens=5)
    out["warm/tp2"] = dict(warm_up_compiles=before, after=warm.compile_count - before)
    for case in out.values():
        if isinstance(case, dict):
            case.pop("logits", None)
    print(json.dumps(out))


def _params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


if __name__ == "__main__":
    sys.exit(main())
