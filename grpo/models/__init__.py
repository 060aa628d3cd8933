"""Models in memory: loading, forward passes, the sampler's decode step, vLLM, devices."""
