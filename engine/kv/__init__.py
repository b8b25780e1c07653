"""The paged KV cache: its blocks, its tensors, how many tokens it holds, INT8 key smoothing."""
