"""Speculative decoding through the server: `python -m jaxllm.serve --speculative ngram:3` (tiny model) serves the
same greedy tokens as an engine without it, over HTTP (the `openai` client, `num_speculative_tokens` in the body)
and gRPC (GenerateRequest.num_speculative_tokens); a request may turn it off (0) or ask for fewer drafts, never
more than the server's k (400 / INVALID_ARGUMENT naming the field); /metrics exports vLLM's spec_decode series.
"""

from __future__ import annotations

import time

import grpc
import openai
import pytest

from jaxllm import LLM, EngineOptions
from serve import jaxllm_pb2 as pb
from tests.serve.test_http import HttpServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_speculative")]

MAX_CONTEXT = 256
K = 3
PROMPT = "abc abc abc abc abc abc abc abc"  # a repetitive prompt: prompt lookup finds drafts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = HttpServerProcess(tmp_path_factory.mktemp("spec"), "--max-context", str(MAX_CONTEXT), "--max-running", "4",
                          "--speculative", f"ngram:{K}")
    deadline = time.monotonic() + 180
    while s.get("/health")[0] != 200:
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.1)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", max_context=MAX_CONTEXT, options=EngineOptions(max_seqs=4), progress=False)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("k", [None, 0, 1, K])
def test_http_greedy_tokens_are_the_engines_without_speculation(server, client, reference, k):
    want = reference.generate([PROMPT], max_new_tokens=32, ignore_eos=True)[0]
    drafts_before = server.metrics()["jaxllm_spec_decode_num_draft_tokens_total"]
    extra = {"ignore_eos": True} if k is None else {"ignore_eos": True, "num_speculative_tokens": k}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, extra_body=extra)
    assert out.choices[0].text == want.text
    drafted = server.metrics()["jaxllm_spec_decode_num_draft_tokens_total"] - drafts_before
    assert (drafted == 0) if k == 0 else (drafted > 0)


def test_grpc_greedy_tokens_and_its_opt_out(server, reference):
    want = reference.generate([PROMPT], max_new_tokens=20)[0]
    for k in (None, 0, 2):
        request = pb.GenerateRequest(prompt=PROMPT, max_tokens=20, **({} if k is None else
                                                                     {"num_speculative_tokens": k}))
        got = [t for m in server.stub.Generate(request, timeout=60) for t in m.token_ids]
        assert got == want.token_ids, k


def test_metrics_carry_the_spec_decode_series(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    m = server.metrics()
    assert m["jaxllm_spec_decode_num_drafts_total"] > 0
    assert 0 <= m["jaxllm_spec_decode_num_accepted_tokens_total"] <= m["jaxllm_spec_decode_num_draft_tokens_total"]
    assert 1 <= m["jaxllm_spec_decode_mean_acceptance_length"] <= K + 1


def test_more_drafts_than_the_server_takes_is_refused(server, client):
    with pytest.raises(openai.BadRequestError, match=f"num_speculative_tokens {K + 1} is over the limit {K}"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"num_speculative_tokens":
                                                                                         K + 1})
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4, num_speculative_tokens=K + 1),
                                  timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in err.value.details()
