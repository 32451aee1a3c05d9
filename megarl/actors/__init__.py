"""The model workers: policy, reference and critic (plain classes that also run under torchrun),
the per-process rank classes the worker groups run (policy, critic, SFT, conversion), and the
controller's typed clients of them. One Megatron model in a process is megarl/megatron_runtime/;
the Ray worker groups that run the ranks are megarl/ray_cluster/."""
