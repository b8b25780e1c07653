"""TileInfer's engine: requests in, tokens out, one step at a time (ARCHITECTURE.md)."""

if __name__ != "tileinfer.engine":  # the folder imported by its bare name: kernels/bare_names.py
    from tileinfer.kernels.bare_names import defer

    defer(__name__, __file__)
