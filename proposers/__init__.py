"""TileInfer proposers: draft tokens for speculative decoding, behind engine.interfaces.Proposer."""
