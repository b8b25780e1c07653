"""TileInfer proposers: draft tokens for speculative decoding, behind proposers.base.Proposer."""
