"""End-to-end generation on the tiny default: cached decode vs full recompute, sampling, errors."""

import re

import numpy as np
import pytest

from jaxllm import LLM, EngineOptions

PROMPTS = ["a", "The quick brown fox", "Ragged batches mix very different lengths: " + "x" * 70, "日本語 and émoji 🙂"]


@pytest.fixture(scope="module")
def llm():
    # Small rBlocks and a small token budget force chunked prefill and mixed prefill/decode steps.
    return LLM("tiny", max_context=256, options=EngineOptions(block_size=4, max_tokens_per_step=24), progress=False)


def test_greedy_cached_generation_equals_full_recompute(llm):
    outs = llm.generate(PROMPTS, max_new_tokens=10)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason in ("length", "stop")
        prompt_ids = llm.tokenizer.encode(prompt)
        full = prompt_ids + out.token_ids
        logits = llm.logits(full)  # teacher-forced: row i predicts token i + 1
        predicted = logits[len(prompt_ids) - 1:len(full) - 1].argmax(-1)
        assert predicted.tolist() == out.token_ids
        if out.finish_reason == "length":
            assert len(out.token_ids) == 10
    assert llm.stats().scheduler.pool_blocks_free == llm.stats().scheduler.pool_blocks  # every rBlock returned


def test_output_independent_of_batch_composition(llm):
    kwargs = dict(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    alone = llm.generate([PROMPTS[1]], **kwargs)[0]
    crowded = llm.generate([PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[3]], **kwargs)[1]
    assert alone.token_ids == crowded.token_ids
    other_seed = llm.generate([PROMPTS[1]], **{**kwargs, "seed": 99})[0]
    assert other_seed.token_ids != alone.token_ids


def test_greedy_step_variant_changes_no_token(llm, monkeypatch):
    """Decode steps whose sequences are all greedy run the argmax-only step variant; beside a sampled
    sequence the step carries the sampler. A greedy request's tokens must be the same either way."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams

    calls = []
    run = llm.executor.worker.run
    monkeypatch.setattr(llm.executor.worker, "run", lambda call, inputs: calls.append(call.greedy) or run(call, inputs))
    try:
        alone = llm.generate([PROMPTS[1]], max_new_tokens=8)[0].token_ids
        assert True in calls  # the greedy variant ran
        calls.clear()
        greedy = Request(llm.tokenizer.encode(PROMPTS[1]), SamplingParams(max_new_tokens=8))
        sampled = Request(llm.tokenizer.encode(PROMPTS[2]),  # outlives the greedy one (no EOS stop)
                          SamplingParams(max_new_tokens=16, temperature=0.9, seed=3, ignore_eos=True))
        outputs = list(llm.run([greedy, sampled]).values())
    finally:
        monkeypatch.undo()
    assert True not in calls  # a sampled sequence was in every step
    assert [t for out in outputs[0] for t in out.token_ids] == alone
    assert sum(len(out.token_ids) for out in outputs[1]) == 16


def test_preemption_gives_the_same_tokens():
    roomy = LLM("tiny", max_context=128, options=EngineOptions(block_size=4, max_tokens_per_step=32), progress=False)
    # 24 rBlocks of 4 tokens cannot hold all four sequences at once: the youngest get preempted.
    tight = LLM("tiny", max_context=96,
                options=EngineOptions(block_size=4, num_blocks=24, max_tokens_per_step=32), progress=False)
    prompts = ["first prompt here", "second one", "third prompt, longer than the rest", "fourth"]
    kwargs = dict(max_new_tokens=30, temperature=0.7, seed=7)
    expected = roomy.generate(prompts, **kwargs)
    got = tight.generate(prompts, **kwargs)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.text for c in got] == [c.text for c in expected]
    assert tight.core.stats().scheduler.pool_blocks_free == 24


def test_stream_matches_generate(llm):
    pieces = list(llm.stream(PROMPTS[3], max_new_tokens=12, temperature=0.5, seed=3))
    whole = llm.generate([PROMPTS[3]], max_new_tokens=12, temperature=0.5, seed=3)[0]
    assert "".join(pieces) == whole.text
    assert llm.stats().scheduler.pool_blocks_free == llm.stats().scheduler.pool_blocks


def test_text_is_the_decode_of_the_token_ids_without_a_stop_string(llm):
    """Property: a completion that no stop string cut has text == decode(token ids), however its bytes end (the
    random tiny model samples bytes that leave characters unfinished: the final flush's U+FFFD is kept), through
    generate and stream alike."""
    rng = np.random.default_rng(11)
    unfinished = 0
    for n in range(1, 9):  # one max_new_tokens per call: a mix of endings
        prompts = [rng.integers(3, 259, size=int(rng.integers(2, 9))).tolist() for _ in range(4)]
        for prompt, out in zip(prompts, llm.generate(prompts, max_new_tokens=n, temperature=1.0, seed=n)):
            decoded = llm.tokenizer.decode(out.token_ids)
            assert out.text == decoded, (prompt, out)
            unfinished += decoded.endswith("\ufffd")
        if n % 3 == 0:
            out = llm.generate(prompts[:1], max_new_tokens=n, temperature=1.0, seed=n)[0]
            assert "".join(llm.stream(prompts[0], max_new_tokens=n, temperature=1.0, seed=n)) == out.text
    assert unfinished >= 3, unfinished
    assert llm.stats().scheduler.pool_blocks_free == llm.stats().scheduler.pool_blocks


def test_ignore_eos_runs_to_max_new_tokens(llm):
    sampled = dict(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.95, seed=9)
    # Find prompts whose sample hits EOS early (the random tiny model does for some), then rerun them.
    prompts = [f"{i}: 日本語 🙂" for i in range(16)]
    early = [(p, c) for p, c in zip(prompts, llm.generate(prompts, **sampled))
             if c.finish_reason == "stop" and len(c.token_ids) < 12]
    assert early, "precondition: no prompt stopped at EOS; use more prompts"
    prompt, first = early[0]
    out = llm.generate([prompt, "a"], ignore_eos=True, **sampled)
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out), out
    assert out[0].token_ids[:len(first.token_ids)] == first.token_ids  # same tokens up to where EOS stopped it
    assert "".join(llm.stream(prompt, ignore_eos=True, **sampled)) == out[0].text


def test_stop_string_truncates(llm):
    base = llm.generate(["stop test"], max_new_tokens=16)[0]
    assert len(base.text) > 4
    stop = base.text[2:4]
    out = llm.generate(["stop test"], max_new_tokens=16, stop=[stop])[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:base.text.find(stop)]
    streamed = "".join(llm.stream("stop test", max_new_tokens=16, stop=[stop]))
    assert streamed == out.text


def test_abandoned_stream_frees_blocks(llm):
    it = llm.stream("abandon me", max_new_tokens=50)
    next(it)
    it.close()
    assert llm.stats().scheduler.pool_blocks_free == llm.stats().scheduler.pool_blocks
    assert not llm.scheduler.has_work()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[""], max_new_tokens=4), "prompt 0 is empty"),
    (dict(prompts=["ok", ""], max_new_tokens=4), "prompt 1 is empty"),
    (dict(prompts=[], max_new_tokens=4), "prompts is empty"),
    (dict(prompts=["x" * 300], max_new_tokens=4), "more than the context limit 256"),
    (dict(prompts=["ok"], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=["ok"], max_new_tokens=-3), "max_new_tokens"),
    (dict(prompts=["ok"], max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(prompts=["ok"], max_new_tokens=4, top_p=1.5), "top_p"),
    (dict(prompts=["ok"], max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(prompts=["ok"], max_new_tokens=4, top_k=-1), "top_k"),
    (dict(prompts=["ok"], max_new_tokens=4, stop=[""]), "stop"),
])
def test_bad_generate_arguments(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(**kwargs)
    assert not llm.scheduler.has_work()


def test_bad_logits_arguments(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.logits([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.logits([1, 5000])
    with pytest.raises(ValueError, match="the context limit 256"):
        llm.logits([5] * 257)


def test_unknown_model_names_the_presets():
    with pytest.raises(ValueError, match="tiny"):
        LLM("no-such-model", progress=False)


@pytest.mark.parametrize("options,message", [
    (dict(attention_backend="cudnn"), "attention_backend 'cudnn' is not one of"),
    (dict(kv_memory_fraction=1.5), "kv_memory_fraction must be in"),
    (dict(max_seqs=0), "max_seqs must be positive"),
])
def test_bad_engine_options(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**options)


def test_bad_max_context():
    with pytest.raises(ValueError, match="max_context"):
        LLM("tiny", max_context=0, progress=False)


def test_max_context_past_the_window_is_refused_naming_it(capsys):
    """99,999,999 is refused before anything is allocated for it, naming the window and where it comes from; the
    window itself is fine, and past it only when asked (random-weight benchmarks of long contexts)."""
    import subprocess
    import sys

    from jaxllm.model.config import LlamaConfig, RopeScaling

    window = "over the model's context window of 2048 tokens (max_position_embeddings 2048)"
    with pytest.raises(ValueError, match=f"max_context 99999999 is {re.escape(window)}: use at most 2048"):
        LLM("tiny", max_context=99_999_999, progress=False)
    small = EngineOptions(block_size=16, num_blocks=8)
    assert LLM("tiny", max_context=2048, options=small, progress=False).max_context == 2048
    assert LLM("tiny", max_context=4096, allow_long_context=True, options=small, progress=False).max_context == 4096
    scaled = LlamaConfig.tiny(rope_scaling=RopeScaling("linear", 4.0))  # RoPE scaling moves the window
    assert (scaled.max_context, scaled.describe_max_context()) == (
        8192, "linear RoPE scaling: max_position_embeddings 2048 x factor 4")
    # Both entry points: exit status 2 and one line naming the window.
    from jaxllm.generate import main

    assert main(["--max-context", "99999999", "hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and window in captured.err
    serve = subprocess.run([sys.executable, "-m", "jaxllm.serve", "--port", "0", "--no-metrics", "--quiet",
                            "--max-context", "99999999"], capture_output=True, text=True, timeout=300)
    assert serve.returncode == 2 and serve.stderr.count("\n") == 1 and window in serve.stderr, serve.stderr


def test_generate_cli(capsys):
    from jaxllm.generate import main

    assert main(["--max-new-tokens", "5", "hello"]) == 0
    assert capsys.readouterr().out.startswith("hello")
    assert main(["--model", "nope", "hi"]) == 2
    assert "nope" in capsys.readouterr().err


def test_no_new_compiles_after_warm_up(capsys):
    llm = LLM("tiny", max_context=128, options=EngineOptions(block_size=8, max_seqs=8, max_tokens_per_step=32),
              progress=False)
    llm.warm_up(progress=True)
    warm = llm.compile_count
    assert warm == len(llm.executor.bucket_shapes())
    # What it announces, what its bar counts to and what compiled are one number (README's start-up shows it).
    err = capsys.readouterr().err
    announced = int(re.search(r"\[jaxllm\] warm-up: (\d+) compiles", err).group(1))
    done, total = map(int, re.search(r"warm-up compiles: done (\d+)/(\d+) in", err).groups())
    assert announced == done == total == warm
    rng = np.random.default_rng(20261127)
    for _ in range(20):  # 200 requests of random lengths and sampling settings, 10 at a time
        prompts = ["".join(chr(97 + c) for c in rng.integers(0, 26, size=n)) for n in rng.integers(1, 100, size=10)]
        temperature = float(rng.uniform(0, 1)) if rng.random() < 0.5 else 0.0  # half the batches greedy
        llm.generate(prompts, max_new_tokens=int(rng.integers(1, 20)), temperature=temperature,
                     top_k=int(rng.integers(0, 5)), seed=int(rng.integers(0, 1000)))
    assert llm.compile_count == warm


def test_shared_prompt_prefix_is_reused_and_changes_no_token():
    """A second prompt with the same long prefix prefills only past the cached full rBlocks, and its
    greedy tokens equal a full recompute (teacher-forced logits) and a run without the cache."""
    options = dict(block_size=4, max_tokens_per_step=24)
    cached = LLM("tiny", max_context=256, options=EngineOptions(**options), progress=False)
    plain = LLM("tiny", max_context=256, options=EngineOptions(**options, prefix_caching=False), progress=False)
    system = "You are a careful assistant. Answer briefly and cite nothing. "
    first, second = system + "Q: what is 2+2?", system + "Q: name a colour."
    cached.generate([first], max_new_tokens=6)
    before = cached.scheduler.cached_tokens
    out = cached.generate([second], max_new_tokens=12)[0]
    shared = len(cached.tokenizer.encode(system)) // 4 * 4  # whole rBlocks of the common prefix
    assert cached.scheduler.cached_tokens - before >= shared > 0
    assert out.token_ids == plain.generate([second], max_new_tokens=12)[0].token_ids
    assert plain.scheduler.cached_tokens == 0 and plain.core.stats().scheduler.cached_blocks == 0
    prompt_ids = cached.tokenizer.encode(second)
    full = prompt_ids + out.token_ids
    predicted = cached.logits(full)[len(prompt_ids) - 1:len(full) - 1].argmax(-1)
    assert predicted.tolist() == out.token_ids
    # The same prompt again: everything but its last token comes from the cache.
    again = cached.generate([second], max_new_tokens=12)[0]
    assert again.token_ids == out.token_ids
    assert cached.stats().scheduler.pool_blocks_free == cached.stats().scheduler.pool_blocks  # cached rBlocks count as free


def test_generate_cli_checks_flags_before_echoing_the_prompt(capsys):
    from jaxllm.generate import main

    assert main(["--max-new-tokens", "0", "hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "max_new_tokens must be >= 1" in captured.err


def test_cli_names_itself_as_started(monkeypatch):
    from jaxllm import cli

    monkeypatch.setattr("sys.argv", ["/usr/bin/jaxllm"])
    assert cli.build_parser().prog == "jaxllm"
    monkeypatch.setattr("sys.argv", ["/x/jaxllm/cli.py"])
    assert cli.build_parser().prog == "python -m jaxllm.cli"


def test_serve_help_shows_one_default_per_flag():
    from jaxllm.serve import build_parser

    for line in build_parser().format_help().splitlines():
        assert line.count("default") <= 1 and "None" not in line, line
