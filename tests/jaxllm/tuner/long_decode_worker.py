"""test_compiles' 512K-context decode, in its own process: `python long_decode_worker.py` warms up an executor whose
rBlock tables reach 512K tokens, decodes at 1 .. 512K tokens of context, and prints one JSON line of its compile
counts and what the steps returned. Its own process because the interpreted kernels' loops over 512K tokens run
several times slower at the suite's -O0 (tests/workers.py) than the compiles it saves here."""

import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.contract import StepPlan
from jaxllm.executor.executor import build_executor
from jaxllm.model.config import LlamaConfig
from jaxllm.model.kv_cache import init_kv_cache
from jaxllm.model.llama import Llama
from pallas_kernels.dispatch import Kernels

BLOCK_SIZE, NUM_BLOCKS, LONGEST = 256, 8, 1 << 19


def _decode_plan(lengths: list[int]) -> StepPlan:
    """A real decode step at these context lengths; its rBlock tables reuse a small pool's rBlocks over and
    over (the values read do not matter here, the shapes do)."""
    s = len(lengths)
    width = max(-(-n // BLOCK_SIZE) for n in lengths)
    tables = np.stack([np.arange(width) % NUM_BLOCKS for _ in lengths]).astype(np.int32)
    positions = np.array([n - 1 for n in lengths], np.int32)
    slots = np.array([tables[i, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for i, p in enumerate(positions)],
                     np.int32)
    return StepPlan(seq_ids=np.arange(s), token_ids=np.full(s, 5, np.int32), positions=positions,
                    slot_mapping=slots, cu_q_lens=np.arange(s + 1, dtype=np.int32),
                    kv_lens=np.array(lengths, np.int32), block_tables=tables, sample=np.ones(s, bool),
                    temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
                    seed=np.zeros(s, np.int32))


def main() -> None:
    # Driven at the executor: a 512K-token pool or prefill is out of reach on a CPU, a decode step at 512K is not.
    # The Pallas kernels (interpreted) read only up to each kv_len, where the reference would gather the whole
    # 512K-token table width for every token, padding included.
    config = LlamaConfig.tiny(num_layers=1, max_position_embeddings=2 * LONGEST)  # one layer: compile counts, not depth
    kernels = Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    # Decode steps of 1 and 2 sequences are what this measures; prefill has one bucket (8 tokens), compiled at warm-up
    # and counted like the others (each program a few seconds at XLA's default optimization, one layer).
    executor = build_executor(Llama(config, rngs=nnx.Rngs(0)), init_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, jnp.float32),
                        max_seqs=2, max_tokens_per_step=8, table_width=LONGEST // BLOCK_SIZE + 1, kernels=kernels)
    compiles = lambda: (executor.compile_count, executor.xla_compiles + executor.persistent_cache_hits)  # noqa: E731
    executor.warm_up(progress=False)
    warm = compiles()
    steps = []
    for lengths in ([1], [1000], [4097, 3], [LONGEST, 1]):
        tokens = executor.step(_decode_plan(lengths))
        steps.append(dict(lengths=lengths, tokens=np.asarray(tokens).tolist()))
    print(json.dumps(dict(plan=len(executor.warm_up_plan()), warm=warm, after=compiles(), steps=steps,
                          vocab_size=config.vocab_size,
                          bucket_steps=sorted([[kind.label, size, n] for (kind, size), n in executor.bucket_steps.items()]))))


if __name__ == "__main__":
    main()
