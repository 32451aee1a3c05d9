"""megarl: reinforcement-learning post-training of LLMs on Megatron-core, SGLang and Ray."""

from megarl.lazy_compile import install as _lazy_compile

__version__ = "0.1.0"

_lazy_compile()  # megatron-core's import about 2.5 s shorter in every process that trains (megarl/lazy_compile.py)
