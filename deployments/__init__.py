"""TileInfer deployments."""
