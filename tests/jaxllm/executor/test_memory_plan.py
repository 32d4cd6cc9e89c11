"""Memory planning: the pool's budget is what is left after the largest step programs' needs (XLA's memory analysis,
compiled over an abstract pool before any pool exists) and the margin; a borrowed prefill step's extra needs do not
grow with the context (the rBlock-table width), only with the chunk."""

import functools

import jax
from flax import nnx

import jaxllm.builder as builder_module
import jaxllm.memory_plan as memory_plan_module
from jaxllm.contract import StepKind
from jaxllm import LLM, EngineOptions
from jaxllm.executor.executor import build_executor
from jaxllm.memory_plan import _MEMORY_MARGIN_MIN, HOST_COPY_BYTES, plan_memory
from jaxllm.model.checkpoints import load_model
from jaxllm.model.kv_cache import init_kv_cache, kv_bytes_per_block
from sharding.mesh import make_mesh
from sharding.rules import abstract_kv_pool, shard_params
from tests.devices import needs_host_devices

GiB = 1 << 30


def test_the_pool_gets_what_the_largest_step_and_the_margin_leave():
    plan = plan_memory(100 * GiB, {"decode 256": 3 * GiB, "prefill 4096 borrowed": 5 * GiB})
    assert plan.margin_bytes == 3 * GiB  # 3% of the free memory, over the 1 GiB floor
    assert plan.pool_bytes == 92 * GiB and "prefill 4096 borrowed" in plan.describe()
    small = plan_memory(10 * GiB, {"decode 8": GiB // 2})
    assert small.margin_bytes == _MEMORY_MARGIN_MIN and small.pool_bytes == 10 * GiB - GiB // 2 - GiB
    assert plan_memory(10 * GiB, {"decode 8": GiB // 2}, host_tier=True).pool_bytes == small.pool_bytes - 2 * HOST_COPY_BYTES
    assert plan_memory(GiB, {"prefill 4096": 2 * GiB}).pool_bytes == 0  # nothing left: LLM says MemoryError


def _abstract_pool(config, num_blocks: int, mesh):
    return abstract_kv_pool(jax.eval_shape(functools.partial(init_kv_cache, config, num_blocks, 16, "float32")), mesh)


@needs_host_devices
def test_step_memory_compiles_over_an_abstract_pool_and_borrowing_needs_do_not_grow_with_the_context():
    mesh = make_mesh(1, 2)
    model = load_model("tiny", progress=False)[0]
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, shard_params(state, mesh))
    needs = {}
    for width in (8, 64):  # rBlock-table widths: one sequence of 128 or 1,024 tokens over both pools
        executor = build_executor(model, _abstract_pool(model.config, 2 * 32, mesh), max_seqs=4, max_tokens_per_step=64,
                            table_width=width, mesh=mesh, instances=2, borrowing=True, backend="reference")
        assert executor.worker.abstract_pool
        needs[width] = executor.step_memory(kinds=(StepKind.PREFILL,))
    assert set(needs[8]) == {"prefill 64", "prefill 64 borrowed"}, needs[8]
    assert all(v > 0 for v in needs[8].values())
    extra = {w: needs[w]["prefill 64 borrowed"] - needs[w]["prefill 64"] for w in needs}
    # The borrowed prefill gathers the chunk's q/k/v over the instances and merges partials: its extra grows with the
    # chunk, not with how much KV the sequences have. (Decode is not compared here: the reference attention gathers
    # each row's KV, and a borrowed decode step has a row per instance and sequence; the Pallas kernels on a GPU
    # read the pool in place.)
    assert extra[8] > 0 and abs(extra[64] - extra[8]) <= 0.05 * extra[8], extra


def test_an_engine_plans_its_pool_from_the_free_memory(monkeypatch, capsys):
    # A CPU host keeps no allocator limit; given one, the engine plans as on a GPU.
    free = 256 << 20
    monkeypatch.setattr(builder_module, "device_free_bytes", lambda devices: free)
    monkeypatch.setattr(memory_plan_module, "_MEMORY_MARGIN_MIN", 4 << 20)  # a GPU's 1 GiB floor is over this whole host
    llm = LLM("tiny", options=EngineOptions(max_seqs=4, max_tokens_per_step=64, penalties=False))
    try:
        plan = llm.memory_plan
        assert plan.free_bytes == free and set(plan.step_bytes) == {"decode 4", "prefill 64"}
        assert plan.pool_bytes == free - max(plan.step_bytes.values()) - plan.margin_bytes > 0
        per_block = kv_bytes_per_block(llm.config, llm.info().block_size, llm.info().kv_dtype)
        assert llm.info().num_blocks == plan.pool_bytes // per_block
        assert "for the KV pool" in capsys.readouterr().err
        assert llm.generate(["hello"], max_new_tokens=4)[0].token_ids  # the planned pool serves
    finally:
        llm.close()
    # A fraction, where set, is taken as it is.
    llm = LLM("tiny", options=EngineOptions(max_seqs=4, max_tokens_per_step=64, kv_memory_fraction=0.5,
                                            penalties=False), progress=False)
    try:
        per_block = kv_bytes_per_block(llm.config, llm.info().block_size, llm.info().kv_dtype)
        assert llm.memory_plan is None and llm.info().num_blocks == (free // 2) // per_block
    finally:
        llm.close()
