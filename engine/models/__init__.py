"""The model: its shape, the decoder, RoPE, and loading it from safetensors, GGUF or the hub."""
