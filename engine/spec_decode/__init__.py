"""Speculative decoding in the engine: the proposer interface, the speculator, exact verification."""
