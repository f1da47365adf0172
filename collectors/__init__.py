"""What runs inside the training job (hooks, NVML sampler) and importers of foreign data."""
