"""TileInfer kernels."""
