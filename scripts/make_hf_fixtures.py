"""Writes tests/jaxllm/data/hf_tiny/: one tiny checkpoint per architecture jaxllm loads beside Llama, written by
transformers itself, with transformers' own logits, greedy tokens and chat renderings to compare against.

    pip install torch    # the CPU build is enough
    python scripts/make_hf_fixtures.py             # or --out DIR, --only qwen3 ...

For each of qwen2, qwen3 and mistral it builds the model with transformers (its config class, then
`AutoModelForCausalLM.from_config`), draws random weights at scales that keep logits spread (norm weights and
biases away from their ones / zeros, so a weight loaded wrong shows), and writes `<name>/` with `save_pretrained`
(bfloat16 safetensors, config.json, generation_config.json) and a tokenizer built here with the `tokenizers`
library and saved by transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja). The checkpoint is
then read back by transformers in float32 (eager attention) for `<name>.reference.npz` (the prompt's ids, its
logits [T, vocab] float32, the greedy continuation of `generate`) and `<name>.reference.json` (the same ids,
greedy tokens, the smallest top-1 margin of the greedy steps, and every chat conversation as
`apply_chat_template` renders and tokenizes it). The shapes:

  qwen2    Qwen2ForCausalLM: q/k/v biases, tied embeddings, yarn RoPE (factor 4 over a 32-token window), GQA 4 / 2
  qwen3    Qwen3ForCausalLM: q/k norms, head_dim 32 with hidden 64 / 4 heads, untied, GQA 4 / 2, a model vocabulary
           wider than the tokenizer's (as Qwen's checkpoints have)
  mistral  MistralForCausalLM: sliding_window null, untied, GQA 8 / 2, a byte-fallback BPE tokenizer with [INST]

The chat templates are written here in the manner of each family's (ChatML for Qwen, Qwen3's reasoning turns,
Mistral's [INST]), using the Jinja features the real ones use: namespace, reversed loops, string methods,
raise_exception. CI reads the committed files (tests/jaxllm/model/test_hf_architectures.py), so it needs neither
torch nor transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "jaxllm", "data", "hf_tiny")
NEW_TOKENS = 8
# Seeds whose greedy continuations are not one repeated token and have no near-tie (tried 10..15; Qwen2's tied head
# repeats itself more than the others).
SEEDS = {"qwen2": 10, "qwen3": 12, "mistral": 13}
_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens", "long context models",
           "what is two plus two? it is four.", "be brief and helpful", "think step by step"] * 4

QWEN_CHAT = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_CHAT = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(found=false, last_query=0) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}
        {%- set ns.last_query = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MISTRAL_CHAT = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, after an optional system message') }}
    {%- endif %}
{%- endfor %}
"""

# (messages, add_generation_prompt): the first is the model's prompt.
CONVERSATIONS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
      {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "what is two plus two?"}], True),
    ([{"role": "user", "content": "café naïve 日本 🦙 ok"}], True),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the lazy dog"}], False),
]
QWEN3_EXTRA = [  # reasoning in an earlier turn is dropped, in the turn after the last query kept
    ([{"role": "user", "content": "two plus two?"},
      {"role": "assistant", "content": "<think>\nstep by step\n</think>\n\nfour"},
      {"role": "user", "content": "and three?"}], True),
    ([{"role": "user", "content": "two plus two?"},
      {"role": "assistant", "content": "<think>\nstep by step\n</think>\n\nfour"}], False),
]


def _byte_level_bpe(specials: list[str], vocab_size: int):
    """Qwen's shape: byte-level BPE (GPT-2 byte stand-ins), its control tokens special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _byte_fallback_bpe(specials: list[str], vocab_size: int):
    """Mistral's shape: Metaspace pieces, BPE with byte fallback (<0xXX> byte tokens), its control tokens special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=vocab_size + 256, special_tokens=specials + bytes_))
    return tok


def _tokenizer(name: str):
    from transformers import PreTrainedTokenizerFast

    if name == "mistral":
        rust = _byte_fallback_bpe(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], 64)
        tok = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        tok.chat_template = MISTRAL_CHAT
    else:
        rust = _byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 300)
        tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tok.chat_template = QWEN3_CHAT if name == "qwen3" else QWEN_CHAT
    return tok


def _config(name: str, tok):
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    vocab = len(tok)
    common = dict(num_hidden_layers=2, intermediate_size=96, max_position_embeddings=128, num_key_value_heads=2)
    if name == "qwen2":
        return Qwen2Config(**common, vocab_size=vocab, hidden_size=64, num_attention_heads=4, tie_word_embeddings=True,
                           rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None,
                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32},
                           bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                           architectures=["Qwen2ForCausalLM"])
    if name == "qwen3":
        return Qwen3Config(**common, vocab_size=vocab + 20, hidden_size=64, num_attention_heads=4, head_dim=32,
                           tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                           architectures=["Qwen3ForCausalLM"])
    return MistralConfig(**common, vocab_size=vocab, hidden_size=64, num_attention_heads=8, head_dim=None,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         architectures=["MistralForCausalLM"])


def _randomize(model, seed: int) -> None:
    """Weights at fan-in scale, embeddings at 0.2 (the layers, not the last token, then decide the next: no greedy
    fixed point on one token), norm weights 1 +- 0.3 and biases at 0.5, all from one seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def _greedy(model, ids: list[int]) -> tuple[list[int], float]:
    """transformers' greedy `generate` of NEW_TOKENS tokens (never stopping at EOS), and the smallest gap between
    the best and second-best logit over those steps (a tie would make the comparison meaningless)."""
    import torch

    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(ids):].tolist(), min(margins)


def make(name: str, seed: int, out: str = OUT) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    directory = os.path.join(out, name)
    shutil.rmtree(directory, ignore_errors=True)
    tok = _tokenizer(name)
    config = _config(name, tok)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.to(torch.bfloat16).save_pretrained(directory)
    tok.save_pretrained(directory)

    # Read back as any user would, in float32: the reference is the checkpoint as stored.
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    conversations = CONVERSATIONS + (QWEN3_EXTRA if name == "qwen3" else [])
    chats = []
    for messages, prompt in conversations:
        text = tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)
        chats.append(dict(messages=messages, add_generation_prompt=prompt, text=text, ids=list(ids)))
    prompt_ids = chats[0]["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0].float().numpy()
        greedy, margin = _greedy(model, prompt_ids)
    if margin < 1e-2:
        raise SystemExit(f"{name}: greedy step margin {margin:.2e} is a near-tie; change the seed")
    np.savez_compressed(os.path.join(out, f"{name}.reference.npz"), prompt_ids=np.asarray(prompt_ids, np.int32),
                        logits=logits.astype(np.float32), greedy=np.asarray(greedy, np.int32))
    reference = dict(architecture=config.architectures[0], transformers_version=transformers.__version__,
                     torch_version=torch.__version__, seed=seed, prompt_ids=prompt_ids, greedy=greedy,
                     min_greedy_margin=margin, chats=chats)
    with open(os.path.join(out, f"{name}.reference.json"), "w") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    print(f"{name}: {config.architectures[0]}, vocab {config.vocab_size} (tokenizer {len(tok)}), prompt "
          f"{len(prompt_ids)} tokens, greedy {greedy} (margin {margin:.3f}), {size / 1024:.0f} KiB")
    return reference


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=OUT, help=f"output directory (default {os.path.relpath(OUT, ROOT)})")
    p.add_argument("--only", choices=sorted(SEEDS), nargs="*", default=sorted(SEEDS), help="architectures to write")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name in args.only:
        make(name, SEEDS[name], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
