"""TileInfer kernels. Each module holds an op's torch reference (the CPU path and the ground truth);
the Triton implementations land beside them with the same signatures."""
