"""HF parity on the GPU: a Llama-3-shaped random checkpoint (GQA 32 q / 8 KV heads, head_dim 128, theta
500000, `llama3` RoPE scaling to 128K) written in HF format by transformers itself, loaded by jaxllm in
bfloat16 (Pallas kernels) and by transformers' LlamaForCausalLM in float32 (sdpa); a long prompt's last
positions' logits compared (relative error, top-1 agreement). Prints a table and writes JSON.

    python -m scripts.check_hf_parity_gpu                      # 32K tokens, 2 layers, hidden 4096
    python -m scripts.check_hf_parity_gpu --tokens 256 --layers 1 --hidden 256 --vocab 4096   # CPU dry run

Needs torch and transformers (the GPU machine has both); the project itself does not depend on them.
Few layers keep it fast; hidden 4096 keeps every matmul and the attention at Llama-3-8B's real shape.
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


def write_checkpoint(directory: str, args) -> dict:
    """config.json by transformers' own LlamaConfig.save_pretrained (transformers-5 `rope_parameters`) and
    random bfloat16 safetensors; returns the config dict as written."""
    import ml_dtypes
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    heads, kv_heads = 32, 8
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=128000 % args.vocab, eos_token_id=128001 % args.vocab, architectures=["LlamaForCausalLM"],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    config.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    rng = np.random.default_rng(args.seed)
    D, F, V, hd = args.hidden, config.intermediate_size, args.vocab, args.hidden // heads

    def w(*shape):  # fan-in scaled, so activations stay O(1) through the layers
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(ml_dtypes.bfloat16)

    def norm():
        return (1 + 0.1 * rng.standard_normal(D, dtype=np.float32)).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": norm(), "lm_head.weight": w(V, D)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * hd, D), p + "self_attn.k_proj.weight": w(kv_heads * hd, D),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, D), p + "self_attn.o_proj.weight": w(D, heads * hd),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F),
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
        })
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return raw


def hf_logits(directory: str, ids: np.ndarray, last: int, chunk: int = 2048) -> tuple[np.ndarray, str]:
    """transformers' float32 logits [last, vocab] of the prompt's last positions; frees the GPU after."""
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # transformers 5 takes `dtype=`; 4.x called it `torch_dtype=`.
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa", **{dtype_kw: torch.float32})
    model = model.to(device).eval()
    got = {p.dtype for p in model.parameters()}
    if got != {torch.float32}:
        raise RuntimeError(f"transformers loaded dtypes {got}, expected float32 only")
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None)
    _log(f"[hf] transformers {transformers.__version__} on {device}; rope {rope}")
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
    _log(f"[jaxllm] rope {model.config.rope_scaling}, theta {model.config.rope_theta}, on {jax.devices()[0]}")
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
    p.add_argument("--tokens", type=int, default=32768, help="prompt length (default 32768)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size; 32 heads of hidden/32 (default 4096)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size (default Llama-3's 128256)")
    p.add_argument("--hf-chunk", type=int, default=2048, help="prompt tokens per HF forward pass (default 2048)")
    p.add_argument("--last", type=int, default=64, help="positions compared, at the prompt's end (default 64)")
    p.add_argument("--block-size", type=int, default=256, help="jaxllm rBlock size (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>-<date>-hf-parity.json)")
    args = p.parse_args(argv)
    if args.hidden % 32 or (args.hidden // 32) % 2:
        p.error(f"--hidden {args.hidden} must be a multiple of 64 (32 heads of an even head_dim)")
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
    out = args.out or os.path.join("benchmarks", "results", result_stem(device, "hf-parity", date) + ".json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
