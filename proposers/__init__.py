"""TileInfer proposers."""
