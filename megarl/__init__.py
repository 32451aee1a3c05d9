"""megarl: reinforcement-learning post-training of LLMs on Megatron-core, SGLang and Ray."""

__version__ = "0.1.0"
