"""Sizes of an SGLang server that torch-free readers need (the planner sizes an SGLang judge's
memory from them; megarl/rollout_sglang/server.py launches servers with them)."""

from __future__ import annotations

# KV cache size (tokens) of a CPU server when the spec gives none: SGLang would otherwise size
# it from mem_fraction of the host's RAM.
CPU_MAX_TOTAL_TOKENS = 4096
