"""Run in a subprocess with 8 CPU host devices (test_lending_engine.py): engines of 2, 4 and 8 instances that
lend rBlocks, against one instance with a pool big enough. Prints one JSON line of results."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402

from jaxllm.engine.core import Request  # noqa: E402
from jaxllm.engine.sampling import SamplingParams  # noqa: E402
from jaxllm.llm import LLM, EngineOptions  # noqa: E402

BLOCK = 16
SEED = int(sys.argv[1]) if len(sys.argv) > 1 else int(np.random.SeedSequence().entropy % 2**31)
rng = np.random.default_rng(SEED)


def prompt(n):
    global rng
    return [int(t) for t in rng.integers(3, 250, n)]


def tokens(llm, requests):
    outputs = llm.run(requests)
    return [[t for out in outputs[i] for t in out.token_ids] for i in sorted(outputs)]


def engine(kv, **options):
    return LLM("tiny", options=EngineOptions(block_size=BLOCK, kv_dtype=kv, **options), progress=False)


def stats(llm):
    s = llm.core.stats()
    return dict(preemptions=s.preemptions_total, loans=s.loans_total, borrowed=s.borrowed_blocks,
                recalled=s.recalled_blocks_total, dist_steps=s.dist_steps_total, free=s.pool_blocks_free,
                blocks=s.pool_blocks, lending_instances=s.lending_instances)


results = {"seed": SEED}
reference = {kv: engine(kv, num_blocks=160) for kv in ("bfloat16", "int8")}

# A sequence longer than one instance's pool (64 tokens an instance at 8, 128 at 4, 192 at 2), beside short
# ones, greedy: borrowed prefill and decode, the same tokens as one big pool. The mesh holds them all, so
# nothing may be preempted.
# (instances, rBlocks an instance, KV dtype, prefill tokens a step: 48 cuts the long prompt into chunks that
# start and end inside runs held by different instances)
CASES = ((2, 12, "bfloat16", None), (4, 8, "bfloat16", 48), (8, 4, "int8", None))
for case, (instances, per_instance, kv, step_tokens) in enumerate(CASES):
    if os.environ.get("LENDING_CASES") and str(case) not in os.environ["LENDING_CASES"]:
        continue
    rng = np.random.default_rng([SEED, case])
    long_len = int(per_instance * BLOCK * 1.3) + int(rng.integers(0, 7))
    requests = [Request(prompt(long_len), SamplingParams(max_new_tokens=12, ignore_eos=True)),
                Request(prompt(int(rng.integers(5, 30))), SamplingParams(max_new_tokens=9, ignore_eos=True)),
                Request(prompt(int(rng.integers(5, 30))), SamplingParams(max_new_tokens=7, ignore_eos=True))]
    llm = engine(kv, num_blocks=per_instance, instances=instances, max_tokens_per_step=step_tokens)
    got = tokens(llm, requests)
    want = tokens(reference[kv], requests)
    results[f"long/{instances}/{kv}"] = dict(equal=got == want, got=got, want=want, long_len=long_len,
                                             pool_tokens=per_instance * BLOCK,
                                             context_limit=llm.context_limit, **stats(llm))

# Skew: two long generations land on instance 0 (routing by load sees equal prompts), the short ones on 1;
# instance 0 outgrows its pool while generating. Lending: borrowed, returned, recalled, nothing preempted.
def skewed():
    p = [prompt(40) for _ in range(4)]
    return [Request(p[0], SamplingParams(max_new_tokens=110, ignore_eos=True)), Request(p[1], SamplingParams(max_new_tokens=4, ignore_eos=True)),
            Request(p[2], SamplingParams(max_new_tokens=110, ignore_eos=True)), Request(p[3], SamplingParams(max_new_tokens=4, ignore_eos=True))]


rng = np.random.default_rng([SEED, 100])
requests = skewed()
want = tokens(reference["bfloat16"], requests)
for lending in (True, False):
    llm = engine("bfloat16", num_blocks=16, instances=2, lending=lending)
    got = tokens(llm, requests)
    results[f"skew/lending={lending}"] = dict(equal=got == want, **stats(llm))

# Recall: on instance 0 a long sequence and a shorter one fill the pool; both borrow as they grow; when the
# short one ends its rBlocks free up at home and the long one's borrowed rBlocks are copied home (recalled);
# it goes on generating, borrowing again later. Sequences pinned to instance 0 through its scheduler.
llm = engine("bfloat16", num_blocks=16, instances=2)
home = llm.scheduler.schedulers[0]
long_ids, short_ids = prompt(150), prompt(90)
a = home.add(long_ids, SamplingParams(max_new_tokens=120, ignore_eos=True), max_len=llm.context_limit)
c = home.add(short_ids, SamplingParams(max_new_tokens=40, ignore_eos=True), max_len=llm.context_limit)
recalled_while_running = 0
while llm.core.has_work():
    llm.core.step()
    if a.status.value == "running":
        recalled_while_running = llm.core.stats().recalled_blocks_total
want = tokens(reference["bfloat16"], [Request(long_ids, SamplingParams(max_new_tokens=120, ignore_eos=True)),
                                      Request(short_ids, SamplingParams(max_new_tokens=40, ignore_eos=True))])
results["recall"] = dict(equal=[a.output_ids, c.output_ids] == want, recalled_while_running=recalled_while_running,
                         **stats(llm))

# Warm-up compiles every shape a run of several instances meets, plain and borrowed: none after it.
rng = np.random.default_rng([SEED, 200])
llm = engine("bfloat16", num_blocks=12, instances=2, max_tokens_per_step=32, max_seqs=2)
llm.warm_up(progress=False)
warm = llm.compile_count
requests = [Request(prompt(int(rng.integers(200, 260))), SamplingParams(max_new_tokens=8, ignore_eos=True)),
            Request(prompt(int(rng.integers(5, 40))), SamplingParams(max_new_tokens=5, ignore_eos=True))]
tokens(llm, requests)
results["warm"] = dict(warm_up_compiles=warm, after=llm.compile_count - warm, **stats(llm))

# Nothing borrowed, nothing distributed: on the same warm engine (every rBlock home again), a long request on
# instance 0 and a short one on 1 (routing by load) each fit their home pool. Their joined decode steps pad the
# short row's table with zeros, which name instance 0's rBlock 0: a run with no loan must still run no
# DistAttention step.
before = stats(llm)
padded_elsewhere = []


def _padding_names_another_instance(outputs):
    plan = llm.core.last_plan
    past = np.arange(plan.block_tables.shape[1])[None, :] >= -(-plan.kv_lens[:, None] // BLOCK)
    elsewhere = plan.block_tables // llm.scheduler.blocks_per_instance != plan.instances[:, None]
    padded_elsewhere.append(bool(np.any(past & elsewhere)))


llm.run([Request(prompt(100), SamplingParams(max_new_tokens=6, ignore_eos=True)),
         Request(prompt(20), SamplingParams(max_new_tokens=6, ignore_eos=True))], on_step=_padding_names_another_instance)
after = stats(llm)
results["unborrowed"] = dict(after, **{key: after[key] - before[key] for key in ("preemptions", "loans", "dist_steps")},
                             borrowed_before=before["borrowed"], padded_steps=sum(padded_elsewhere),
                             steps=len(padded_elsewhere))

# Lending off: one instance's pool is the longest context; a longer prompt is refused, naming the limit.
llm = engine("bfloat16", num_blocks=10, instances=2, lending=False)
try:
    llm.generate([prompt(200)], max_new_tokens=2)
    results["refused"] = None
except ValueError as e:
    results["refused"] = str(e)
results["lending_off_context_limit"] = llm.context_limit
print(json.dumps(results))
