"""TileInfer's proposers: draft tokens for speculative decoding, behind
tileinfer.engine.spec_decode.proposer_interface.Proposer."""

if __name__ != "tileinfer.proposers":  # the folder imported by its bare name: kernels/bare_names.py
    from tileinfer.kernels.bare_names import defer

    defer(__name__, __file__)
