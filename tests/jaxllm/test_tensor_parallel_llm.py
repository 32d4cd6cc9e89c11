"""Tensor parallelism through `LLM` on 8 CPU host devices: logits, greedy and seeded tokens equal TP 1's;
each device holds 1/N of the sharded weights and KV pool; checkpoints load straight into their shards.

Each case is computed once per module (fixtures below, cached per case) and asserted on by several tests;
each config's checkpoint and its TP 1 reference are made once and shared by its cases.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxllm.contract import StepKind
from jaxllm.llm import LLM, EngineOptions
from jaxllm.model.checkpoints import load_model, save_hf, save_orbax
from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import init_model
from sharding import rules
from sharding.mesh import make_mesh
from tests.devices import needs_host_devices

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("jaxllm_tp"), needs_host_devices]

SPLIT = ("attention/qkv", "attention/o", "mlp/gate_up", "mlp/down", "lm_head")
REPLICATED = ("norm/weight", "inv_freq", "embedding")
SMALL = dict(hidden_size=64, num_layers=2, intermediate_size=128, max_position_embeddings=256)
CONFIGS = {
    "mha": LlamaConfig(vocab_size=320, num_heads=8, num_kv_heads=8, name="mha", **SMALL),
    "gqa": LlamaConfig(vocab_size=320, num_heads=8, num_kv_heads=4, name="gqa", **SMALL),
    # 2 KV heads: TP 4 and 8 replicate them; 259 words divide by nothing, so the head is replicated
    "gqa_wide": LlamaConfig(vocab_size=259, num_heads=8, num_kv_heads=2, name="gqa_wide", **SMALL),
    # llama2-70b's head counts (64 query / 8 KV heads) at a small width
    "70b": LlamaConfig.llama2_70b(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=256,
                                  max_position_embeddings=256),
}
CASES = ["mha/tp2", "mha/tp4", "mha/tp8", "gqa/tp2", "gqa/tp4", "gqa/tp8", "gqa_wide/tp2", "gqa_wide/tp4",
         "gqa_wide/tp8", "70b/tp8"]
# Generation (greedy and seeded) compiles a decode and a prefill step per LLM: run it at one tensor-parallel
# size per config (the widest, where the most is split) and check logits at every size.
GENERATE_AT = {"mha": 8, "gqa": 4, "gqa_wide": 8, "70b": 8}
PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11, 60, 61, 8, 9, 1, 4, 30, 31, 32, 33, 34], [200, 3, 7]]
GEN = dict(max_new_tokens=6, ignore_eos=True)


def _tp(case: str) -> int:
    return int(case.split("/")[1].removeprefix("tp"))


def _options(tp: int, **kw) -> EngineOptions:
    kw = {"num_blocks": 16, "block_size": 8, "max_seqs": 4, "max_tokens_per_step": 32, **kw}
    return EngineOptions(tensor_parallel=tp, **kw)


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


def _relative_error(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _compare(got: dict, want: dict) -> dict:
    out = dict(error=_relative_error(got["logits"], want["logits"]), generated="greedy" in got)
    if "greedy" in got:
        out.update(greedy_equal=got["greedy"] == want["greedy"], sampled_equal=got["sampled"] == want["sampled"],
                   greedy=got["greedy"])
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """config name -> the directory of its HF checkpoint (seed 1 weights), saved once."""
    root = tmp_path_factory.mktemp("jaxllm-tp")

    @functools.cache
    def path(name: str) -> str:
        save_hf(init_model(CONFIGS[name], seed=1), root / name)
        return str(root / name)

    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """config name -> TP 1's logits, greedy and seeded tokens, computed once."""
    return functools.cache(lambda name: _run(LLM(checkpoint(name), progress=False, options=_options(1))))


@pytest.fixture(scope="module")
def tp_result(checkpoint, reference, tmp_path_factory):
    """case -> its result, each computed once (a case that raises fails only the tests that ask for it)."""

    @functools.cache
    def result(case: str) -> dict:
        if case == "orbax/tp4":
            # Orbax, restored with the target shardings, then through LLM at TP 4 (KV heads replicated).
            orbax_dir = tmp_path_factory.mktemp("jaxllm-tp-orbax") / "gqa_wide_orbax"
            save_orbax(init_model(CONFIGS["gqa_wide"], seed=1), orbax_dir)
            llm = LLM(str(orbax_dir), progress=False, options=_options(4))
            return dict(_compare(_run(llm), reference("gqa_wide")),
                        params={k: _held(v) for k, v in _named(llm.executor.worker.state).items()})
        name, tp = case.split("/")[0], _tp(case)
        llm = LLM(checkpoint(name), progress=False, options=_options(tp))
        out = _compare(_run(llm, generate=tp == GENERATE_AT[name]), reference(name))
        info = llm.info()
        out.update(params={k: _held(v) for k, v in _named(llm.executor.worker.state).items()},
                   pool={k: _held(v) for k, v in _named(llm.executor.worker.kv_cache).items()},
                   devices=llm.mesh.devices.size, step_kv_heads=llm.executor.worker.config.num_kv_heads,
                   info=dict(tensor_parallel=info.tensor_parallel, instances=info.instances,
                             processes=info.processes, devices=info.devices, num_kv_heads=info.num_kv_heads))
        return out

    return result


@pytest.fixture(scope="module")
def hf_load_result(checkpoint):
    """Loading alone: each Param arrives in its shards (TP 4, KV heads split, not replicated)."""
    mesh = make_mesh(4)
    model, _ = load_model(checkpoint("gqa"), progress=False,
                          sharding=functools.partial(rules.load_sharding, mesh=mesh))
    return {k: _held(v) for k, v in _named(nnx.state(model, nnx.Param)).items()}


@pytest.fixture(scope="module")
def triton_result():
    """The Pallas kernels (interpret mode) per device inside shard_map, through the executor's Kernels."""
    tiny = LLM("tiny", progress=False, options=_options(1, block_size=16, num_blocks=4))
    ref = tiny.logits(PROMPTS[0][:9])
    kernels = LLM("tiny", progress=False, options=_options(2, block_size=16, num_blocks=4, attention_backend="triton"))
    got = kernels.logits(PROMPTS[0][:9])
    prefill = kernels.executor.variants.kernels_for(StepKind.PREFILL, 8)  # the smallest prefill bucket's
    return dict(error=_relative_error(got, ref), per_shard=prefill.per_shard is not None)


@pytest.fixture(scope="module")
def warm_result():
    """Warm-up on a mesh compiles what serving meets, continuations (tokens from the last step's output) included.
    Buckets for the two prompts alone (decode 1 and 2, prefill 8 and 16): each one more is a compile."""
    warm = LLM("tiny", progress=False, options=_options(2, max_seqs=2, max_tokens_per_step=16))
    warm.warm_up(progress=False)
    before = warm.compile_count
    warm.generate(["hello there", "abc"], max_new_tokens=5)
    return dict(warm_up_compiles=before, after=warm.compile_count - before)


@pytest.mark.parametrize("case", CASES + ["orbax/tp4"])
def test_logits_and_tokens_equal_tensor_parallel_1(tp_result, case):
    assert jax.device_count() == 8
    r = tp_result(case)
    assert r["error"] < 1e-5, r["error"]
    if r["generated"]:  # one tensor-parallel size per config generates (GENERATE_AT)
        assert r["greedy_equal"] and r["sampled_equal"], r
        assert all(len(tokens) == 6 for tokens in r["greedy"])


def test_every_config_generates_at_some_tensor_parallel_size(tp_result):
    generated = {case.split("/")[0] for case in CASES if tp_result(case)["generated"]}
    assert generated == {case.split("/")[0] for case in CASES}, generated


def _assert_split(params: dict, n: int, devices: int, vocab: int) -> None:
    """Each weight split n ways or whole (the head split over the vocabulary only where n divides it)."""
    assert params
    for name, held in params.items():
        assert held["devices"] == devices, (name, held)
        if name.endswith(SPLIT) and (vocab % n == 0 or not name.endswith("lm_head")):
            assert held["fraction"] == pytest.approx(1 / n), (name, held)
        else:
            assert name.endswith(REPLICATED + ("lm_head",)) and held["fraction"] == 1.0, (name, held)


@pytest.mark.parametrize("case", CASES + ["orbax/tp4"])
def test_each_device_holds_its_share_of_weights_and_pool(tp_result, case):
    n, r = _tp(case), tp_result(case)
    config = CONFIGS["gqa_wide" if case == "orbax/tp4" else case.split("/")[0]]
    _assert_split(r["params"], n, n, config.vocab_size)
    for name, held in r.get("pool", {}).items():
        assert held["fraction"] == pytest.approx(1 / n) and held["devices"] == n, (name, held)
    if "pool" in r:
        assert len(r["pool"]) == 2 * 2  # k and v of both layers


def test_kv_heads_replicated_when_fewer_than_the_tensor_axis(tp_result):
    assert tp_result("gqa/tp4")["step_kv_heads"] == 4  # split
    assert tp_result("gqa/tp8")["step_kv_heads"] == 8  # 4 KV heads, each on 2 devices
    assert tp_result("gqa_wide/tp8")["step_kv_heads"] == 8
    assert tp_result("gqa_wide/tp8")["info"]["num_kv_heads"] == 2  # info reports the model's own


def test_info_reports_the_mesh(tp_result):
    assert tp_result("gqa/tp4")["info"] == dict(tensor_parallel=4, instances=1, processes=1, devices=4,
                                                num_kv_heads=4)


def test_hf_checkpoint_loads_straight_into_its_shards(hf_load_result):
    _assert_split(hf_load_result, 4, 4, CONFIGS["gqa"].vocab_size)


def test_pallas_kernels_run_per_shard(triton_result):
    r = triton_result
    assert r["per_shard"] and r["error"] < 1e-5, r


def test_nothing_compiles_after_warm_up_on_a_mesh(warm_result):
    r = warm_result
    assert r["warm_up_compiles"] > 0 and r["after"] == 0, r


def test_a_preset_is_drawn_straight_into_its_shards():
    """A random-weight preset on a mesh is built in its shards (no device ever holds a split weight whole: what lets
    the 70B preset start on 4 GPUs), the same model as on one device up to float rounding."""
    from jaxllm.model.checkpoints import load_model

    model, _ = load_model("tiny", sharding=functools.partial(rules.load_sharding, mesh=make_mesh(2)))
    _assert_split({k: _held(v) for k, v in _named(nnx.state(model, nnx.Param)).items()}, 2, 2, 259)
    one = LLM("tiny", progress=False, options=_options(1))
    two = LLM("tiny", progress=False, options=_options(2))
    want = one.logits(PROMPTS[0])
    assert float(np.max(np.abs(two.logits(PROMPTS[0]) - want)) / np.max(np.abs(want))) < 1e-5


@pytest.mark.parametrize("config", [dataclasses.replace(CONFIGS["gqa"], num_layers=3),
                                    dataclasses.replace(CONFIGS["mha"], tie_word_embeddings=True)],
                         ids=["gqa-3-layers", "mha-tied"])
def test_a_sharded_draw_gives_every_weight_of_the_unsharded_one(config):
    """The sharded draw runs one program a layer (keys from where Llama.__init__ would be at that layer) and the
    embedding and head apart: every array equals the unsharded draw's, each in its sharding."""
    sharded = init_model(config, seed=3, sharding=rules.load_sharding(config, make_mesh(4)))
    whole = nnx.to_pure_dict(nnx.state(init_model(config, seed=3)))
    drawn = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(sharded))))
    assert len(drawn) == len(jax.tree.leaves(whole))
    for path, want in jax.tree_util.tree_leaves_with_path(whole):
        np.testing.assert_allclose(np.asarray(drawn[path]), np.asarray(want), rtol=0, atol=1e-6, err_msg=str(path))
    last, first = sharded.layers[-1].mlp.down[...].sharding, sharded.layers[0].mlp.down[...].sharding
    assert last == first and not last.is_fully_replicated
