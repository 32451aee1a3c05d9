"""Per-GPU memory estimates for training and rollout (what the planner checks before launch).

An estimate, documented term by term so a user can see which knob moves which number:

Training, per GPU of a role with layout (tp, pp, dp), for the heaviest pipeline stage:
- weights: dtype bytes x params on the stage / tp
- grads: fp32 (4 B) x params on the stage / tp (Megatron's grad buffer accumulates in fp32)
- optimizer: fp32 master copy + Adam m and v = 12 B x params on the stage / tp, divided by dp
  with the distributed optimizer
- activations: per token per layer, the tensors kept for backward (see activation_bytes_per_token);
  pipeline 1F1B keeps up to pp micro-batches in flight on stage 0, so stage 0 holds
  layers_per_stage x pp = num_layers layers' worth; full recompute keeps only each layer's input.
  Attention uses SDPA (flash / memory-efficient): no [seq x seq] score matrix is kept, which is
  why selective recompute saves nothing more here.
- logits: fp32 [tokens x vocab / tp], twice (logits and their softmax / gradient)
- runtime: CUDA context, NCCL and allocator slack (a constant, RUNTIME_OVERHEAD_GIB)

Rollout (SGLang): mem_fraction x GPU memory for weights / rollout.tp plus the KV cache; the KV
cache size gives how many sequences of full length run at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.architectures import ArchSpec

GIB = 1024**3
RUNTIME_OVERHEAD_GIB = 3.0
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class TrainMemory:
    """Bytes per GPU of one trained model (policy or critic) at its heaviest pipeline stage."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float

    @property
    def states(self) -> float:
        """What stays resident between steps unless offloaded."""
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.states + self.activations + self.logits


def stage_params(arch: ArchSpec, pp: int, *, value_head: bool = False) -> int:
    """Parameters on the heaviest pipeline stage (before TP sharding)."""
    per_stage = arch.num_layers // pp
    body = per_stage * arch.layer_params
    embed = arch.embedding_params
    head = arch.hidden_size if value_head else arch.embedding_params
    if pp == 1:
        shared = embed if (arch.tie_embeddings and not value_head) else embed + head
        return body + shared + arch.hidden_size
    # The first stage holds the embedding, the last the output layer (a copy when tied).
    return body + max(embed, head + arch.hidden_size)


def activation_bytes_per_token(arch: ArchSpec, tp: int, sequence_parallel: bool, dtype_bytes: int = 2) -> float:
    """Bytes kept for backward per token per layer.

    TP-sharded: q/k/v, attention output, fc1 (gate and up) and its activation output.
    Not sharded unless sequence parallel: residual input, the two norm outputs, the
    attention-block output. Plus fp32 norm statistics (negligible, ignored).
    """
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q_dim = arch.num_heads * arch.kv_channels
    kv_dim = arch.num_kv_heads * arch.kv_channels
    sharded = (q_dim + 2 * kv_dim) + q_dim + 2 * f + f
    replicated = 4 * h
    if sequence_parallel:
        replicated /= tp
    return dtype_bytes * (sharded / tp + replicated)


def train_memory(
    arch: ArchSpec,
    *,
    tp: int,
    pp: int,
    dp: int,
    tokens_per_micro_batch: int,
    dtype: str,
    recompute: str,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    value_head: bool = False,
    trainable: bool = True,
) -> TrainMemory:
    params = stage_params(arch, pp, value_head=value_head) / tp
    wbytes = DTYPE_BYTES[dtype]
    layers_in_flight = arch.num_layers  # stage 0 under 1F1B: layers/pp x pp micro-batches
    if not trainable:
        act = 0.0
    elif recompute == "full":
        act = tokens_per_micro_batch * layers_in_flight * arch.hidden_size * wbytes / (tp if sequence_parallel else 1)
        act += tokens_per_micro_batch * activation_bytes_per_token(arch, tp, sequence_parallel, wbytes)
    else:
        act = tokens_per_micro_batch * layers_in_flight * activation_bytes_per_token(arch, tp, sequence_parallel, wbytes)
    vocab = 1 if value_head else arch.vocab_size
    logits = 2 * 4 * tokens_per_micro_batch * vocab / tp
    return TrainMemory(
        weights=wbytes * params,
        grads=4 * params if trainable else 0.0,
        optimizer=(12 * params / (dp if distributed_optimizer else 1)) if trainable else 0.0,
        activations=act,
        logits=logits,
    )


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes per GPU taken by one SGLang engine rank."""

    budget: float  # mem_fraction x GPU memory
    weights: float
    kv_cache: float
    kv_bytes_per_token: float
    full_length_sequences: int  # sequences of max_prompt + max_new tokens that fit at once


def rollout_memory(arch: ArchSpec, *, tp: int, gpu_bytes: float, mem_fraction: float, dtype: str, seq_len: int) -> RolloutMemory:
    wbytes = DTYPE_BYTES[dtype]
    weights = wbytes * arch.num_params / tp
    kv_heads_per_rank = max(1, arch.num_kv_heads // tp)  # SGLang replicates KV heads when tp > kv heads
    kv_per_token = 2 * arch.num_layers * kv_heads_per_rank * arch.kv_channels * wbytes
    budget = mem_fraction * gpu_bytes
    kv = max(0.0, budget - weights)
    return RolloutMemory(budget, weights, kv, kv_per_token, int(kv // (kv_per_token * seq_len)))
