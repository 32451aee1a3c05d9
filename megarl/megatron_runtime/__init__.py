"""One Megatron model inside a worker process: build through the bridge, micro-batching,
vocab-parallel log-probs, the update loop with its optimizer and schedule, offload.
Knows nothing of Ray."""
