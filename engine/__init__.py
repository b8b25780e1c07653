"""TileInfer engine."""
