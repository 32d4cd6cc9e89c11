"""EleutherAI's lm-evaluation-harness against the real server, as its users run it.

`lm_eval.simple_evaluate(model="local-completions", ...)` evaluates a local multiple-choice task and a local
generate_until task (YAML + JSONL written into tmp_path) against `python -m jaxllm.serve --http-only` on an
HF-format directory (`jaxllm convert tiny`): lm-eval tokenizes with that directory's tokenizer.json
(transformers, `tokenizer_backend=huggingface`), sends token-id prompts, and for each choice reads the
loglikelihood from `echo: true, logprobs: 1, max_tokens: 1`. Every loglikelihood it reports is checked against
the sum of log_softmax(LLM.logits(context + continuation)) over the continuation, and every generation against
LLM.generate. Offline: the HF libraries are told so, and any connection to a non-loopback host fails the test.
Skipped where lm-eval is not installed (the `test` extra installs it).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import socket
import time

import numpy as np
import pytest

from jaxllm import LLM, EngineOptions, cli
from tests.serve.test_http import HttpServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("lm_eval"),
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                       reason="lm-eval is not installed (pip install -e '.[test]' installs it)"),
]

MAX_CONTEXT = 512
STEP_TOKENS = 64
MAX_RUNNING = 4
TOLERANCE = 2e-3  # nats, on a whole continuation's loglikelihood

MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "twenty-two"], "answer": 0},
    {"question": "Water freezes at", "choices": ["zero degrees", "one hundred degrees"], "answer": 0},
    {"question": "Le café est", "choices": ["chaud", "froid", "très, très bon", "ünïcode ☕"], "answer": 2},
    {"question": "The colour of the sky on a clear day is", "choices": ["blue", "green"], "answer": 0},
]
GENERATE = [
    {"question": "Say hello:", "answer": "hello"},
    {"question": "Count: one, two,", "answer": "three"},
]
MAX_GEN_TOKENS = 8


def _task_files(root) -> None:
    """Two local tasks: lm-eval task configs (written as JSON, which YAML reads) over JSONL files, loaded by HF
    datasets' `json` builder with its cache under root."""
    for name, rows, task in (
            ("jaxllm_mc", MULTIPLE_CHOICE, {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
                                            "metric_list": [{"metric": "acc"}]}),
            ("jaxllm_gen", GENERATE, {"output_type": "generate_until", "metric_list": [{"metric": "exact_match"}],
                                      "generation_kwargs": {"until": ["\n"], "do_sample": False,
                                                            "max_gen_toks": MAX_GEN_TOKENS}})):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        task |= {"task": name, "dataset_path": "json", "test_split": "test", "doc_to_text": "{{question}}",
                 "doc_to_target": "{{answer}}",
                 "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "datasets")}}
        (root / f"{name}.yaml").write_text(json.dumps(task, indent=1))


def _loopback(host) -> bool:
    if host in (None, "localhost", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
    except ValueError:
        return False


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The HF libraries offline with their caches in tmp; a lookup of or a connection to any host but this
    machine's loopback raises and is recorded in the list yielded (libraries that swallow the error, as
    transformers' hub probes do, would otherwise hide it)."""
    home = tmp_path_factory.mktemp("hf_home")
    real_getaddrinfo = socket.getaddrinfo
    attempts: list = []

    def getaddrinfo(host, *args, **kwargs):
        if not _loopback(host):
            attempts.append(host)
            raise socket.gaierror(f"test_lm_eval is offline: no lookup of {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    def guarded(real):
        def connect(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
                attempts.append(address)
                raise ConnectionRefusedError(f"test_lm_eval is offline: no connection to {address!r}")
            return real(sock, address)
        return connect

    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                            ("HF_HOME", str(home)), ("HF_DATASETS_CACHE", str(home / "datasets"))):
            mp.setenv(name, value)  # before the server starts (it copies os.environ) and lm_eval is imported
        mp.setattr(socket, "getaddrinfo", getaddrinfo)
        for name in ("connect", "connect_ex"):
            mp.setattr(socket.socket, name, guarded(getattr(socket.socket, name)))
        yield attempts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm_eval") / "tiny-hf"
    assert cli.main(["convert", "tiny", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def server(offline, checkpoint, tmp_path_factory):
    # No warm-up: the few step shapes these requests need compile as they come (warm-up would compile them all,
    # ~30 s here); what is under test is what lm-eval sends and reads, not the start-up.
    s = HttpServerProcess(tmp_path_factory.mktemp("lm_eval_server"), "--http-only", "--model", str(checkpoint),
                          "--max-context", str(MAX_CONTEXT), "--max-tokens-per-step", str(STEP_TOKENS),
                          "--max-running", str(MAX_RUNNING), "--max-logprobs", "1", "--no-warm-up")
    yield s
    s.close()


@pytest.fixture(scope="module")
def llm(server, checkpoint):  # built while the server loads and warms up
    options = EngineOptions(max_tokens_per_step=STEP_TOKENS, max_seqs=MAX_RUNNING)
    return LLM(str(checkpoint), max_context=MAX_CONTEXT, options=options, progress=False)


def _wait_healthy(server, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while server.get("/health")[0] != 200:
        assert time.monotonic() < deadline and server.proc.poll() is None, f"not healthy; stderr:\n{server.log()}"
        time.sleep(0.1)


def _continuation_logprob(llm, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval computes, from the model itself: the continuation's tokens (as lm-eval splits context +
    continuation: no BOS, the continuation being what follows the context's tokens), each scored by
    log_softmax of the teacher-forced logits one position before it; and whether each is the argmax."""
    ids = llm.tokenizer.encode(context + continuation, add_bos=False)
    n = len(llm.tokenizer.encode(context, add_bos=False))
    logits = llm.logits(ids).astype(np.float64)[n - 1:-1]  # [continuation, vocab]: the positions predicting it
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    targets = np.asarray(ids[n:])
    return float(logprobs[np.arange(len(targets)), targets].sum()), bool((logprobs.argmax(-1) == targets).all())


def test_lm_eval_scores_as_the_model_does(offline, server, llm, checkpoint, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    _task_files(tmp_path)
    _wait_healthy(server)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": str(checkpoint), "base_url": f"{server.url}/completions",
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": MAX_CONTEXT,
                    "num_concurrent": MAX_RUNNING, "max_retries": 1, "timeout": 60},
        tasks=["jaxllm_mc", "jaxllm_gen"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, bootstrap_iters=0)

    mc = results["results"]["jaxllm_mc"]
    assert "acc,none" in mc and 0.0 <= mc["acc,none"] <= 1.0, mc
    assert "exact_match,none" in results["results"]["jaxllm_gen"]
    samples = results["samples"]
    assert len(samples["jaxllm_mc"]) == len(MULTIPLE_CHOICE) and len(samples["jaxllm_gen"]) == len(GENERATE)

    diffs = []
    for sample in samples["jaxllm_mc"]:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        for (context, continuation), ((loglikelihood, is_greedy),) in zip(sample["arguments"], sample["resps"]):
            want, want_greedy = _continuation_logprob(llm, context, continuation)
            diffs.append(abs(loglikelihood - want))
            print(f"{context!r} + {continuation!r}: lm-eval {loglikelihood:.6f}, LLM.logits {want:.6f}, "
                  f"diff {diffs[-1]:.2e}")
            assert diffs[-1] < TOLERANCE, (context, continuation, loglikelihood, want)
            assert is_greedy == want_greedy, (context, continuation)
    print(f"{len(diffs)} loglikelihoods, max |lm-eval - LLM.logits| = {max(diffs):.2e}")

    for sample in samples["jaxllm_gen"]:
        (context, gen_kwargs), = sample["arguments"]
        ids = llm.tokenizer.encode(context, add_bos=False)
        want = llm.generate([ids], max_new_tokens=MAX_GEN_TOKENS, temperature=0,
                            stop=["\n", llm.tokenizer.eos_token])[0].text  # lm-eval adds the EOS text to `until`
        assert sample["resps"] == [[want]], (context, sample["resps"], want)
    assert offline == [], f"tried to reach the network: {offline}"
