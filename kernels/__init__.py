"""TileInfer's kernels. Each module holds an op's torch reference (the CPU path and the ground truth);
the Triton implementations land beside them with the same signatures."""

if __name__ != "tileinfer.kernels":  # the folder imported by its bare name: kernels/bare_names.py
    from tileinfer.kernels.bare_names import defer

    defer(__name__, __file__)
