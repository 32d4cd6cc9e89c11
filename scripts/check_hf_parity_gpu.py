"""HF parity on the GPU: a random checkpoint of one architecture's real shape written in HF format by
transformers itself, loaded by jaxllm in bfloat16 (Pallas kernels) and by transformers (AutoModelForCausalLM) in
float32 (sdpa); a long prompt's last positions' logits compared (relative error, top-1 agreement). Prints a table
and writes JSON. --arch picks the shape (ARCHS):

  llama3   Llama-3.1-8B: GQA 32 q / 8 KV heads, head_dim 128, theta 500000, `llama3` RoPE scaling to 128K
  qwen3    Qwen3-8B: GQA 32 / 8, head_dim 128, q/k RMSNorms (random weights), theta 1e6, 40K window
  qwen2    Qwen2.5-7B: GQA 28 / 4, head_dim 128, q/k/v biases (random), theta 1e6, yarn x4 over 32K (Qwen's 128K)
  mistral  Mistral-7B-v0.3: GQA 32 / 8, head_dim 128, theta 1e6, sliding_window null

    python -m scripts.check_hf_parity_gpu                      # llama3, 32K tokens, 2 layers, hidden 4096
    python -m scripts.check_hf_parity_gpu --arch qwen3         # Qwen3-8B's shape at a 32K prompt
    python -m scripts.check_hf_parity_gpu --arch qwen3 --tokens 256 --layers 1 --hidden 256 --vocab 4096  # CPU

Needs torch and transformers (the GPU machine has both); the project itself does not depend on them.
Few layers keep it fast; the default hidden size keeps every matmul and the attention at the real shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

# Before jax is imported: jax must not take the GPU memory torch needs (torch runs first, then frees it).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

# bf16 weights and activations against float32: the budget of a bfloat16 forward at this length.
MAX_REL_ERR = 3e-2
MIN_TOP1 = 0.85  # random weights leave near-ties that bf16 rounding may flip


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# Each architecture's real shape: its transformers config class and keys, query / KV heads (head_dim is hidden /
# heads), the MLP width as a fraction of hidden, the full vocabulary and hidden size.
ARCHS = {
    "llama3": dict(config="LlamaConfig", heads=32, kv_heads=8, mlp=(7, 2), vocab=128256, hidden=4096,
                   keys=dict(max_position_embeddings=131072, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})),
    "qwen3": dict(config="Qwen3Config", heads=32, kv_heads=8, mlp=(3, 1), vocab=151936, hidden=4096,
                  keys=dict(max_position_embeddings=40960, rms_norm_eps=1e-6, attention_bias=False,
                            use_sliding_window=False, sliding_window=None, architectures=["Qwen3ForCausalLM"],
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": dict(config="Qwen2Config", heads=28, kv_heads=4, mlp=(37, 7), vocab=152064, hidden=3584,
                  keys=dict(max_position_embeddings=131072, rms_norm_eps=1e-6, use_sliding_window=False,
                            sliding_window=None, architectures=["Qwen2ForCausalLM"],
                            rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                             "original_max_position_embeddings": 32768})),
    "mistral": dict(config="MistralConfig", heads=32, kv_heads=8, mlp=(7, 2), vocab=32768, hidden=4096,
                    keys=dict(max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
                              architectures=["MistralForCausalLM"],
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def write_checkpoint(directory: str, args) -> dict:
    """config.json by transformers' own config class (save_pretrained: transformers-5 `rope_parameters`) and
    random bfloat16 safetensors, the architecture's biases and q/k norms included; returns the config dict as
    written."""
    import ml_dtypes
    import transformers
    from safetensors.numpy import save_file

    arch = ARCHS[args.arch]
    heads, kv_heads = arch["heads"], arch["kv_heads"]
    hd = args.hidden // heads
    config = getattr(transformers, arch["config"])(
        vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.hidden * arch["mlp"][0] // arch["mlp"][1],
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **arch["keys"])
    config.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    rng = np.random.default_rng(args.seed)
    D, F, V = args.hidden, config.intermediate_size, args.vocab

    def w(*shape):  # fan-in scaled, so activations stay O(1) through the layers
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(ml_dtypes.bfloat16)

    def norm(n=D):
        return (1 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(ml_dtypes.bfloat16)

    def bias(n):  # Qwen2's q/k/v biases: O(1), as trained ones are
        return (0.5 * rng.standard_normal(n, dtype=np.float32)).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": norm(), "lm_head.weight": w(V, D)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * hd, D), p + "self_attn.k_proj.weight": w(kv_heads * hd, D),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, D), p + "self_attn.o_proj.weight": w(D, heads * hd),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F),
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
        })
        if args.arch == "qwen2":
            tensors.update({p + "self_attn.q_proj.bias": bias(heads * hd),
                            p + "self_attn.k_proj.bias": bias(kv_heads * hd),
                            p + "self_attn.v_proj.bias": bias(kv_heads * hd)})
        if args.arch == "qwen3":
            tensors.update({p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return raw


def hf_logits(directory: str, ids: np.ndarray, last: int, chunk: int = 2048) -> tuple[np.ndarray, str]:
    """transformers' float32 logits [last, vocab] of the prompt's last positions; frees the GPU after."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # transformers 5 takes `dtype=`; 4.x called it `torch_dtype=`.
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa", **{dtype_kw: torch.float32})
    model = model.to(device).eval()
    got = {p.dtype for p in model.parameters()}
    if got != {torch.float32}:
        raise RuntimeError(f"transformers loaded dtypes {got}, expected float32 only")
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None)
    _log(f"[hf] transformers {transformers.__version__} on {device}: {type(model).__name__}; rope {rope}")
    # Prefilled in chunks through HF's own KV cache: float32 sdpa with GQA takes the math path, whose
    # scores for a 32K prompt in one pass ([32 heads, T, T] float32) would need 128 GiB.
    tokens = torch.as_tensor(ids[None], device=device)
    cache, outputs = transformers.DynamicCache(), []
    with torch.no_grad():
        for start in range(0, tokens.shape[1], chunk):
            out = model.model(input_ids=tokens[:, start:start + chunk], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            outputs = (outputs + [out.last_hidden_state[0]])[-(last // chunk + 2):]  # enough to hold the last rows
        hidden = torch.cat(outputs)[-last:]
        logits = model.lm_head(hidden).float().cpu().numpy()
    del model, hidden, cache, outputs
    if device == "cuda":
        torch.cuda.empty_cache()
    return logits, transformers.__version__


def jaxllm_logits(directory: str, ids: np.ndarray, last: int, block_size: int) -> np.ndarray:
    """jaxllm's logits [last, vocab] (float32) of one bfloat16 prefill over the whole prompt."""
    import jax
    import jax.numpy as jnp

    from jaxllm.model.checkpoints import load_hf
    from jaxllm.model.kv_cache import init_kv_cache
    from pallas_kernels.dispatch import AttentionBatch, default_kernels

    model = load_hf(directory, dtype="bfloat16", progress=False)
    _log(f"[jaxllm] {model.config.architecture} (q/k/v bias {model.config.qkv_bias}, q/k norm "
         f"{model.config.qk_norm}); rope {model.config.rope_scaling}, theta {model.config.rope_theta}, on "
         f"{jax.devices()[0]}")
    T = len(ids)
    nb = -(-T // block_size)
    kv = init_kv_cache(model.config, num_blocks=nb, block_size=block_size, dtype="bfloat16")
    batch = AttentionBatch(block_tables=jnp.arange(nb, dtype=jnp.int32)[None], kv_lens=jnp.array([T], jnp.int32),
                           cu_q_lens=jnp.array([0, T], jnp.int32), slot_mapping=jnp.arange(T, dtype=jnp.int32))
    # The kernels the engine runs on this device (Pallas on a GPU: Mosaic prefill on Hopper), not the reference.
    kernels = default_kernels("auto", head_dim=model.config.head_dim)
    _log(f"[jaxllm] kernels: prefill {kernels.prefill_attention}, rope+KV write {kernels.rope_kv_write}")
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.arange(T, dtype=jnp.int32), kv, batch, kernels=kernels)
    return np.asarray(model.logits(hidden[-last:]), np.float32)


def compare(ours: np.ndarray, ref: np.ndarray, positions: np.ndarray) -> tuple[list[dict], dict]:
    rows = []
    for k, pos in enumerate(positions):
        a, b = ours[k].astype(np.float64), ref[k].astype(np.float64)
        rows.append({"position": int(pos), "rel_err": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
                     "max_abs_err": float(np.max(np.abs(a - b))), "top1_ours": int(a.argmax()),
                     "top1_hf": int(b.argmax())})
    rel = float(np.linalg.norm(ours.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64)))
    top1 = float(np.mean([r["top1_ours"] == r["top1_hf"] for r in rows]))
    summary = {"rel_err": rel, "max_row_rel_err": max(r["rel_err"] for r in rows), "top1_agreement": top1,
               "pass": bool(rel < MAX_REL_ERR and top1 >= MIN_TOP1), "max_rel_err_allowed": MAX_REL_ERR,
               "min_top1_allowed": MIN_TOP1}
    return rows, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama3",
                   help="the architecture and real shape of the checkpoint (default llama3: Llama-3.1-8B)")
    p.add_argument("--tokens", type=int, default=32768, help="prompt length (default 32768)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden size, split into the architecture's heads (default its real one: 4096, qwen2 3584)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default the architecture's real one)")
    p.add_argument("--hf-chunk", type=int, default=2048, help="prompt tokens per HF forward pass (default 2048)")
    p.add_argument("--last", type=int, default=64, help="positions compared, at the prompt's end (default 64)")
    p.add_argument("--block-size", type=int, default=256, help="jaxllm rBlock size (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>-<date>-hf-parity.json)")
    args = p.parse_args(argv)
    arch = ARCHS[args.arch]
    args.hidden = arch["hidden"] if args.hidden is None else args.hidden
    args.vocab = arch["vocab"] if args.vocab is None else args.vocab
    if args.hidden % arch["heads"] or (args.hidden // arch["heads"]) % 2:
        p.error(f"--hidden {args.hidden} must be a multiple of {2 * arch['heads']} ({arch['heads']} heads of an even "
                "head_dim)")
    if not 0 < args.last <= args.tokens:
        p.error(f"--last {args.last} must be in [1, --tokens {args.tokens}]")

    import jax

    from scripts.common.harness import result_stem

    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    ids = np.random.default_rng(args.seed + 1).integers(0, args.vocab, args.tokens)
    with tempfile.TemporaryDirectory() as directory:
        t0 = time.time()
        raw = write_checkpoint(directory, args)
        _log(f"checkpoint written in {time.time() - t0:.0f}s ({args.layers} layers, hidden {args.hidden})")
        t0 = time.time()
        ref, hf_version = hf_logits(directory, ids, args.last, args.hf_chunk)
        _log(f"[hf] {time.time() - t0:.0f}s")
        t0 = time.time()
        ours = jaxllm_logits(directory, ids, args.last, args.block_size)
        _log(f"[jaxllm] {time.time() - t0:.0f}s")
    positions = np.arange(args.tokens - args.last, args.tokens)
    rows, summary = compare(ours, ref, positions)

    print(f"{'position':>9} {'rel err':>10} {'max abs':>10} {'top1 jaxllm':>12} {'top1 hf':>8}")
    for r in rows[:: max(1, len(rows) // 16)]:
        print(f"{r['position']:>9} {r['rel_err']:>10.2e} {r['max_abs_err']:>10.2e} {r['top1_ours']:>12} "
              f"{r['top1_hf']:>8}")
    print(f"overall rel err {summary['rel_err']:.3e} (max row {summary['max_row_rel_err']:.3e}), top-1 agreement "
          f"{summary['top1_agreement']:.3f}: {'PASS' if summary['pass'] else 'FAIL'} "
          f"(allowed rel err < {MAX_REL_ERR}, top-1 >= {MIN_TOP1})")

    result = {"script": "scripts/check_hf_parity_gpu.py", "device": device, "date": date,
              "jax_version": jax.__version__, "transformers_version": hf_version,
              "args": vars(args), "hf_config": raw, "summary": summary, "rows": rows}
    name = "hf-parity" if args.arch == "llama3" else f"hf-parity-{args.arch}"  # llama3: the name it always had
    out = args.out or os.path.join("benchmarks", "results", result_stem(device, name, date) + ".json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
