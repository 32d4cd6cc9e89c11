"""The model: Llama config and presets, the Flax NNX Llama, RoPE, tokenizers, checkpoint formats."""
