"""The model workers: policy, reference and critic (plain classes that also run under torchrun),
the per-process rank classes the worker groups run, and the controller's typed clients.

Sub-packages: ``megatron_runtime`` (one Megatron model in a process: build, forward,
train, offload) and ``ray_groups`` (Ray placement groups, worker groups, the session)."""
