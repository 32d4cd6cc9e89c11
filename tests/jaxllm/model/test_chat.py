"""Chat prompts: a checkpoint's Jinja chat_template as transformers renders it, the Llama-2 [INST] fallback,
errors, and LLM.chat end to end on a tiny HF checkpoint with a tokenizer.json and several EOS ids."""

from __future__ import annotations

import json

import pytest

from jaxllm.model.chat import ChatError, chat_prompt, render_chat
from jaxllm.model.config import LlamaConfig
from jaxllm.model.tokenizer import ByteTokenizer
from jaxllm.model.tokenizer_files import load_tokenizer
from tests.jaxllm.model.numpy_llama import random_hf_tensors
from tests.jaxllm.model.test_hf_tokenizer import LLAMA3_TEMPLATE, _byte_level_bpe
from tests.jaxllm.model.test_weights import _write_hf

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2? "}]


def test_llama3_template():
    text = render_chat(CONVO, template=LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = render_chat(CONVO, template=LLAMA3_TEMPLATE, bos_token="B", eos_token="E", add_generation_prompt=False)
    assert no_prompt.startswith("B<|start") and no_prompt.endswith("2+2?<|eot_id|>")


def test_transformers_environment_features():
    # trim_blocks / lstrip_blocks, raise_exception, tojson keeping non-ASCII, loop controls
    template = ("{% for m in messages %}\n  {% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n"
                "{{ m['content'] | tojson }}{% if loop.last %}{% break %}{% endif %}\n{% endfor %}")
    assert render_chat([{"role": "user", "content": "日本"}], template=template) == '"日本"'
    with pytest.raises(ChatError, match="no tools"):
        render_chat([{"role": "tool", "content": "x"}], template=template)
    with pytest.raises(ChatError, match="does not parse"):
        render_chat(CONVO, template="{% for %}")


def test_llama2_fallback():
    text = render_chat(CONVO, template=None)
    assert text == ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
                    "<s>[INST] 2+2? [/INST]")
    assert render_chat([{"role": "user", "content": " Hi "}], template=None) == "<s>[INST] Hi [/INST]"
    # LLM.generate adds the BOS id itself: chat_prompt cuts the template's leading BOS text
    assert chat_prompt(ByteTokenizer(), [{"role": "user", "content": "Hi"}]) == "[INST] Hi [/INST]"


@pytest.mark.parametrize("messages,message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], "message 0 must be a dict"),
    ([{"role": "robot", "content": "x"}], "message 0 must be a dict with role in"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternating"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message must be the user's"),
    ([{"role": "system", "content": "a"}], "must be followed by a user message"),
])
def test_malformed_messages(messages, message):
    with pytest.raises(ChatError, match=message):
        render_chat(messages, template=None)


def test_roles_listed_are_the_roles_the_renderer_renders():
    """Llama-2's format has no tool turn: `tool` is refused there, naming the format, and never listed as allowed;
    a checkpoint's own template gets tool messages (it renders them, or refuses with its own message)."""
    convo = [{"role": "user", "content": "2+2?"}, {"role": "tool", "content": "4"}]
    with pytest.raises(ChatError, match=r"message 1 has role 'tool', which Llama-2's \[INST\] format \(used where "
                                        r"the checkpoint has no chat_template\) cannot render; roles: \['system', "
                                        r"'user', 'assistant'\]$"):
        render_chat(convo, template=None)
    with pytest.raises(ChatError) as err:
        render_chat([{"role": "robot", "content": "x"}], template=None)
    assert "['system', 'user', 'assistant']" in str(err.value) and "tool" not in str(err.value)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert render_chat(convo, template=template) == "user: 2+2?\ntool: 4\n"
    with pytest.raises(ChatError, match=r"role in \['system', 'user', 'assistant', 'tool'\]"):
        render_chat([{"role": "robot", "content": "x"}], template=template)


def test_content_must_be_valid_text():
    with pytest.raises(ChatError, match=r"messages\[1\].content is not valid text: it holds the lone surrogate U\+DC00"):
        render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\udc00"}], template=None)


def test_llm_chat_end_to_end(tmp_path):
    from jaxllm import LLM

    tok = _byte_level_bpe()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|eot_id|>",
                                                                "chat_template": LLAMA3_TEMPLATE}))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, max_position_embeddings=256)
    hf = config.to_hf()
    _write_hf(tmp_path, random_hf_tensors(hf, seed=0), hf)
    llm = LLM(str(tmp_path), progress=False)
    messages = [{"role": "user", "content": "hello world"}]
    ids = llm.tokenizer.encode(chat_prompt(llm.tokenizer, messages))
    assert ids.count(llm.tokenizer.bos_id) == 1 and ids[0] == llm.tokenizer.bos_id
    out = llm.chat(messages, max_new_tokens=4)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert out.token_ids == llm.generate(chat_prompt(llm.tokenizer, messages), max_new_tokens=4)[0].token_ids
    # every EOS id of generation_config.json stops generation: with all ids listed, the first token stops
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(vocab))}))
    llm = LLM(str(tmp_path), progress=False)
    stopped = llm.chat(messages, max_new_tokens=4)
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
