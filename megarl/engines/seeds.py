"""Seed derivation for rollout sampling: (run seed, step) -> step seed; (step seed, sample) -> sample seed.

A sample's random stream depends only on the step's base seed and the sample's global index
within the step's request, never on batch composition, chunking or which engine served it, so a
resumed run regenerates exactly what an uninterrupted one would have. The mixing is splitmix64
(a bijective 64-bit finaliser): nearby inputs give unrelated seeds. Deliberately not here: any
RNG state; callers build their own ``torch.Generator`` from the returned integer.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(a: int, b: int) -> int:
    """A 63-bit seed from two integers (non-negative, so ``manual_seed`` takes it as is)."""
    return _splitmix64(_splitmix64(a & _MASK64) ^ (b & _MASK64)) >> 1


def step_seed(run_seed: int, step: int) -> int:
    """The base seed of RL step ``step`` (what goes into ``SamplingParams.seed``)."""
    return _mix(run_seed, step)


def shuffle_seed(run_seed: int, step: int) -> int:
    """The seed of step ``step``'s mini-batch shuffles (actor.shuffle): a function of the run seed
    and the step alone, so a resumed run shuffles as the uninterrupted one with no RNG state
    checkpointed, and apart from the step's sampling seed."""
    return _mix(run_seed ^ 0x5AFF1E, step)


def sample_seed(base_seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` (global index within the step's request)."""
    return _mix(base_seed ^ 0x5EED, sample_index)
