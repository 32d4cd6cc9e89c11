"""One engine start for test_compiles' persistent-cache test: `python cache_worker.py [CACHE_DIR]` (without
CACHE_DIR, $JAXLLM_COMPILE_CACHE names it) warms up a tiny engine, generates, and prints one JSON line of
its compile counts and tokens."""

import json
import sys

from jaxllm.tuner.compile_cache import compile_events


def main() -> None:
    start = compile_events()  # the listeners first: every compile of this process is seen
    from jaxllm import LLM, EngineOptions

    options = EngineOptions(block_size=16, max_seqs=2, max_tokens_per_step=16, tuner="fixed",
                            compile_cache_dir=sys.argv[1] if len(sys.argv) > 1 else None)
    llm = LLM("tiny", max_context=256, options=options, progress=False)
    llm.warm_up(progress=False)
    completions = llm.generate(["hello", "a prompt of a few more tokens than the last"], max_new_tokens=5)
    events = compile_events() - start
    print(json.dumps(dict(plan=len(llm.executor.warm_up_plan()), traces=llm.compile_count,
                          runner_xla=llm.executor.xla_compiles, runner_hits=llm.executor.persistent_cache_hits,
                          process_xla=events.xla_compiles, process_hits=events.cache_hits,
                          process_writes=events.cache_writes, tokens=[c.token_ids for c in completions])))


if __name__ == "__main__":
    main()
