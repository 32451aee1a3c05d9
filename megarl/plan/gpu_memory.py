"""Per-GPU memory estimates for training and rollout (what the planner checks before launch).

An estimate, documented term by term so a user can see which knob moves which number:

Training, per GPU of a role with layout (tp, pp, dp), for the heaviest pipeline stage:
- weights: dtype bytes x params on the stage / tp
- grads: fp32 (4 B) x params on the stage / tp (Megatron's grad buffer accumulates in fp32)
- optimizer: fp32 master copy + Adam m and v = 12 B x params on the stage / tp, divided by dp
  with the distributed optimizer; with fp32 weights the master copy is the weights themselves
  (Megatron's optimizer steps the model's own params), so 8 B
- activations: per token per layer, the tensors kept for backward (see activation_bytes_per_token);
  pipeline 1F1B keeps up to pp micro-batches in flight on stage 0, so stage 0 holds
  layers_per_stage x pp = num_layers layers' worth; full recompute keeps only each layer's input.
  Attention uses SDPA (flash / memory-efficient): no [seq x seq] score matrix is kept, which is
  why selective recompute saves nothing more here.
- logits (the LM head's working memory): log-probs are computed from the hidden states in chunks
  of actor.logprob_chunk_tokens tokens, so at most a chunk's fp32 [chunk x vocab / tp] logits
  exist, four times in a backward (logits, log-probs, probabilities, their gradient); an update
  adds the output layer's gradient, [vocab / tp x hidden], summed in fp32 over the chunks when a
  micro-batch has several and then cast to the weights' dtype (head_grad; with tied embeddings
  on one stage, autograd adds the embedding's own gradient to it: not counted).
  The critic's value head is [tokens x 1].
- runtime: the trainer process's CUDA context, NCCL buffers and allocator slack
  (TRAINER_RUNTIME_GIB, on every GPU of a trained model)

Rollout (SGLang): mem_fraction x the memory a server sees free when it sizes its KV cache, for
weights / rollout.tp plus the KV cache; the KV cache size gives how many sequences of full
length run at once. SGLang measures that free memory after its own CUDA context and NCCL buffers
exist and, colocated, beside the trainer's process (whose models are off the GPU then: the
launch phase), so it is the GPU less SGLANG_CONTEXT_GIB and, colocated, TRAINER_RUNTIME_GIB
(:func:`sglang_free_at_launch`). Its CUDA-graph pool and allocator cache come after the KV cache,
outside mem_fraction (SGLANG_GRAPHS_GIB: the engine's ``cuda_graph`` state, there while it
generates). The torch engine: a full copy of the weights in each replica leader, and while it
generates a KV cache of max_running_requests sequences of full length; it runs in the trainer's
process (no runtime of its own).

Host memory per node: megarl/plan/host_memory.py.

Which of these are on a GPU in which phase of the step is the residency table's business
(megarl/memory/residency.py); the planner adds them up per phase, plus each phase's working
memory (:func:`phase_working_bytes`) and the runtime memory (:class:`RuntimeMemory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.architectures import ArchSpec
from megarl.memory.residency import (
    CRITIC_FORWARD,
    CRITIC_UPDATE,
    POLICY_FORWARD,
    POLICY_UPDATE,
    REFERENCE_FORWARD,
    WEIGHT_PUSH,
)

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# What the processes on a GPU hold besides the states and working memory counted here, per GPU.
# Estimates, not measurements: the GPU probe (ci/gpu/probe_cluster_paths.py, not yet run on a GPU)
# measures them and its results are to replace these numbers. Together 3 GiB on a GPU of trained models
# alone and 7 GiB on a colocated one (two CUDA contexts, both sides' NCCL buffers, SGLang's graphs:
# 6-10 GiB is expected there).
TRAINER_RUNTIME_GIB = 3.0  # a trainer process: CUDA context, its NCCL communicators' buffers, allocator slack
SGLANG_CONTEXT_GIB = 1.5  # an SGLang server before it sizes its KV cache: CUDA context, NCCL and custom all-reduce buffers
SGLANG_GRAPHS_GIB = 2.5  # after its KV cache, outside mem_fraction: the CUDA-graph pool and the allocator's cache


@dataclass(frozen=True)
class RuntimeMemory:
    """Bytes per GPU the processes hold besides the states and the phases' working memory (the
    estimates above; 0 for a process the GPU does not have)."""

    trainer: float  # the trainer process, in every phase
    sglang_context: float  # the SGLang server, in every phase, from before it sizes its KV cache
    sglang_graphs: float  # the SGLang server's CUDA graphs and allocator cache (its cuda_graph state)

    @property
    def sglang(self) -> float:
        """SGLang's memory outside mem_fraction."""
        return self.sglang_context + self.sglang_graphs


def runtime_memory(*, trainer: bool, sglang: bool) -> RuntimeMemory:
    """The runtime memory of a GPU holding a trainer process and / or an SGLang server."""
    return RuntimeMemory(TRAINER_RUNTIME_GIB * GIB * trainer, SGLANG_CONTEXT_GIB * GIB * sglang, SGLANG_GRAPHS_GIB * GIB * sglang)


def sglang_free_at_launch(gpu_bytes: float, *, colocated: bool) -> float:
    """The memory an SGLang server sees free when it sizes its KV cache (SGLang's
    profile_max_num_token: mem_fraction of the free memory it measured after its own CUDA context
    and NCCL start, less the weights): the GPU less that context and, colocated, less the trainer's
    process, which holds its runtime then (its models are off the GPU at launch)."""
    runtime = runtime_memory(trainer=colocated, sglang=True)
    return gpu_bytes - runtime.sglang_context - runtime.trainer


@dataclass(frozen=True)
class TrainMemory:
    """Bytes per GPU of one trained model (policy or critic) at its heaviest pipeline stage."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    head_grad: float = 0.0  # an update's fp32 accumulator of the output layer's gradient
    optimizer_at_build: float = 0.0  # before the first step: fp32 master copies only (Adam's moments come with it)

    @property
    def states(self) -> float:
        """What stays resident between steps unless offloaded."""
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.states + self.update_working

    @property
    def update_working(self) -> float:
        """An update's working memory besides the states."""
        return self.activations + self.logits + self.head_grad


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
    replicated: float = 4 * h  # divided by tp below
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
    logprob_chunk_tokens: int = 1024,
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
    logits: float
    if value_head:
        logits, head_grad = 2 * 4 * tokens_per_micro_batch, 0.0
    else:
        logits = 4 * 4 * min(logprob_chunk_tokens, tokens_per_micro_batch) * arch.vocab_size / tp
        # Several chunks sum in fp32, then cast: both copies exist for a moment.
        grad_bytes = 4 + (wbytes if wbytes != 4 else 0) if tokens_per_micro_batch > logprob_chunk_tokens else wbytes
        head_grad = grad_bytes * arch.vocab_size / tp * arch.hidden_size if trainable else 0.0
    master = 0 if wbytes == 4 else 4  # fp32 weights are their own master copy
    return TrainMemory(
        weights=wbytes * params,
        grads=4 * params if trainable else 0.0,
        optimizer=((master + 8) * params / (dp if distributed_optimizer else 1)) if trainable else 0.0,
        optimizer_at_build=(master * params / (dp if distributed_optimizer else 1)) if trainable else 0.0,
        activations=act,
        logits=logits,
        head_grad=head_grad,
    )


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes per GPU taken by one SGLang engine rank."""

    budget: float  # mem_fraction x free_at_launch
    weights: float
    kv_cache: float
    kv_bytes_per_token: float
    full_length_sequences: int  # sequences of max_prompt + max_new tokens that fit at once
    free_at_launch: float = 0.0  # what the server sees free when it sizes its KV cache


def rollout_memory(arch: ArchSpec, *, tp: int, free_bytes: float, mem_fraction: float, dtype: str, seq_len: int) -> RolloutMemory:
    """One SGLang engine rank's static memory, from ``free_bytes``, the memory it sees free at
    launch (:func:`sglang_free_at_launch`)."""
    weights = DTYPE_BYTES[dtype] * arch.num_params / tp
    kv_per_token = kv_bytes_per_token(arch, tp, dtype)
    budget = mem_fraction * free_bytes
    kv = max(0.0, budget - weights)
    return RolloutMemory(budget, weights, kv, kv_per_token, int(kv // (kv_per_token * seq_len)), free_bytes)


def kv_bytes_per_token(arch: ArchSpec, tp: int, dtype: str) -> float:
    """K and V of every layer for one token on one engine rank."""
    kv_heads_per_rank = max(1, arch.num_kv_heads // tp)  # SGLang replicates KV heads when tp > kv heads
    return 2 * arch.num_layers * kv_heads_per_rank * arch.kv_channels * DTYPE_BYTES[dtype]


def torch_engine_memory(arch: ArchSpec, *, dtype: str, max_running_requests: int, seq_len: int) -> tuple[float, float]:
    """(weights, KV cache) of a torch engine: the whole model, and at most max_running_requests
    sequences of full length decoded together."""
    return DTYPE_BYTES[dtype] * arch.num_params, max_running_requests * seq_len * kv_bytes_per_token(arch, 1, dtype)


def largest_hf_tensor_bytes(arch: ArchSpec, dtype: str) -> float:
    """The largest full tensor a weight export holds at once: the embedding (or LM head), or an
    MLP or attention projection when those are bigger."""
    h, heads, kv, d = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.kv_channels
    return DTYPE_BYTES[dtype] * max(arch.vocab_size * h, arch.ffn_hidden_size * h, heads * d * h, 2 * kv * d * h)


def phase_working_bytes(policy: TrainMemory | None, critic: TrainMemory | None, bucket_bytes: float,
                        gather_bytes: float) -> dict[str, float]:  # fmt: skip
    """What a phase needs besides the resident states, per GPU: an update's activations, logits
    and head gradient; a forward pass's logits (no activations are kept for a backward); a push's
    buckets (``bucket_bytes``: the one being filled, with rollout.weight_sync.overlap the one
    being sent, and with the tensor and distributed transports its flattened copy), plus one TP
    gather group twice while it is exported (``gather_bytes``: rollout.weight_sync.gather_mb of
    tensors, or one larger tensor alone; its gathered shards and the full tensors they are
    joined into). Approximate: a lone tensor split along dim 0 (the embedding) is gathered into
    place and held once, and a group also holds the rank's copies of its fused-QKV pieces (up to
    1/tp of the group)."""
    out = {WEIGHT_PUSH: bucket_bytes + 2.0 * gather_bytes}
    if policy is not None:
        out |= {POLICY_FORWARD: policy.logits, REFERENCE_FORWARD: policy.logits, POLICY_UPDATE: policy.update_working}
    if critic is not None:
        out |= {CRITIC_FORWARD: critic.logits, CRITIC_UPDATE: critic.update_working}
    return out
