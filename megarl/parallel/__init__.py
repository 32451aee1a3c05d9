"""Process groups, shard/gather across TP/PP, bucketing, pipeline forward passes, and the one
module (cpu_compat) that lets megatron-core run without CUDA. Import submodules directly."""
