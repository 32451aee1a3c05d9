"""Per-GPU memory estimates for training and rollout (what the planner checks before launch).

An estimate, documented term by term so a user can see which knob moves which number:

Training, per GPU of a role with layout (tp, pp, dp), for the heaviest pipeline stage:
- weights: dtype bytes x params on the stage / tp; a mixture-of-experts model's experts / (ep x
  etp) instead (:func:`stage_params_per_gpu`)
- grads: fp32 (4 B) x the same params (Megatron's grad buffer accumulates in fp32)
- optimizer: fp32 master copy + Adam m and v = 12 B x the same params, divided with the
  distributed optimizer by dp, and the experts' by the expert-data-parallel size
  tp x dp / (ep x etp) (the ranks holding the same experts); with fp32 weights the master copy
  is the weights themselves (Megatron's optimizer steps the model's own params), so 8 B
- activations: per token per layer, the tensors kept for backward (see activation_bytes_per_token;
  an MoE layer's router and dispatcher buffers: moe_activation_bytes_per_token);
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
- LoRA (actor.lora): the base model is frozen, so weights are the whole model in its dtype plus
  the adapters (:func:`lora_params_per_gpu`), and grads and optimizer count the adapters only
  (fp32 grad buffer, fp32 main copy and Adam's two moments, sharded over dp by the distributed
  optimizer like any parameter, the experts' adapters over the expert-data-parallel group like
  the experts); the output layer is frozen too: no head_grad. Activations as
  full fine-tuning (the adapters' own, [tokens x rank] per module, are left out).

Rollout (SGLang): mem_fraction x the memory a server sees free when it sizes its KV cache, for
weights / rollout.tp plus the KV cache (an MoE model's experts too: SGLang splits each expert
over its TP ranks, or with its own expert parallelism, whole experts over the same ranks; the
bytes per GPU are the same); the KV cache size gives how many sequences of full
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
    forward_logits: float | None = None  # a forward-only pass's head (its own micro-batches); None = logits
    optimizer_at_build: float = 0.0  # before the first step: fp32 master copies only (Adam's moments come with it)

    @property
    def states(self) -> float:
        """What stays resident between steps unless offloaded."""
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.states + self.update_working

    @property
    def forward_working(self) -> float:
        """A forward-only pass's working memory besides the states (its LM or value head)."""
        return self.logits if self.forward_logits is None else self.forward_logits

    @property
    def update_working(self) -> float:
        """An update's working memory besides the states."""
        return self.activations + self.logits + self.head_grad


def stage_param_split(arch: ArchSpec, pp: int, *, value_head: bool = False) -> list[tuple[int, int]]:
    """(non-expert, expert) parameters of each pipeline stage, before any sharding: its layers,
    the embedding on the first stage, the output layer (a copy when tied) and final norm on the last."""
    per_stage, embed = arch.num_layers // pp, arch.embedding_params
    head = arch.hidden_size if value_head else embed
    out = []
    for s in range(pp):
        dense, experts = arch.layers_params(s * per_stage, (s + 1) * per_stage)
        if s == 0:
            dense += embed
        if s == pp - 1:
            dense += (0 if pp == 1 and arch.tie_embeddings and not value_head else head) + arch.hidden_size
        out.append((dense, experts))
    return out


def stage_params_per_gpu(arch: ArchSpec, *, tp: int, pp: int, ep: int = 1, etp: int = 1,
                         value_head: bool = False) -> tuple[float, float]:  # fmt: skip
    """(non-expert, expert) parameters one GPU holds on the heaviest stage: the non-expert ones
    split over tp (norms and the router too: replicated in fact, but a rounding error here),
    the experts over ep x etp (each rank holds num_experts / ep of them, each split over etp)."""
    per_gpu = [(dense / tp, experts / (ep * etp)) for dense, experts in stage_param_split(arch, pp, value_head=value_head)]
    return max(per_gpu, key=sum)


# The HF linears LoRA can target (megarl.config.train_sections.LORA_MODULES), and whether Megatron
# splits each column-parallel (its output over tp: q, k, v, gate, up) or row-parallel (its input: o, down).
_COLUMN_PARALLEL = {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False,
                    "gate_proj": True, "up_proj": True, "down_proj": False}  # fmt: skip
LORA_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")  # on an MoE layer: each expert's


def lora_module_shapes(arch: ArchSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each HF linear LoRA can target, in one decoder layer. A
    multi-latent attention model (DeepSeek-V3) has no q_proj/k_proj/v_proj that megarl adapts (its
    q and kv projections are low-rank pairs: megarl/models/lora.py wraps none of them), and its
    o_proj reads every head's value, ``heads x v_head_dim`` wide."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    mlp = {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    if arch.is_mla:
        return {"o_proj": (arch.num_heads * arch.v_dim, h), **mlp}
    q, kv = arch.num_heads * arch.kv_channels, arch.num_kv_heads * arch.kv_channels
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), **mlp}


def lora_expert_params(arch: ArchSpec, rank: int, modules: tuple[str, ...]) -> int:
    """Adapter parameters of one mixture-of-experts expert: A [rank x in] and B [out x rank] of each
    targeted gate/up/down at the expert's width, whole on its EP rank (parallel.etp is 1)."""
    width = rank * (arch.hidden_size + arch.moe_ffn_hidden_size)  # gate and up: in h, out f; down: in f, out h
    return width * sum(m in LORA_MLP_MODULES for m in modules)


def lora_stage_params(arch: ArchSpec, rank: int, modules: tuple[str, ...], first: int, last: int) -> tuple[int, int, int]:
    """(replicated over tp, split over tp, on experts) adapter parameters of layers ``first`` ..
    ``last - 1``: a dense layer's targeted modules (:func:`lora_layer_params`); an MoE layer's
    attention ones, and each of its experts' gate/up/down (:func:`lora_expert_params`)."""
    attention = tuple(m for m in modules if m in LORA_ATTENTION_MODULES)
    replicated = split = experts = 0
    for i in range(first, last):
        moe = arch.is_moe_layer(i)
        r, s = lora_layer_params(arch, rank, attention if moe else modules)
        replicated, split = replicated + r, split + s
        experts += arch.num_experts * lora_expert_params(arch, rank, modules) if moe else 0
    return replicated, split, experts


def lora_layer_params(arch: ArchSpec, rank: int, modules: tuple[str, ...]) -> tuple[int, int]:
    """(replicated over tp, split over tp) adapter parameters of one dense decoder layer: A [rank x in]
    and B [out x rank] per targeted module. A column-parallel linear's B is split with its output
    and A replicated; a row-parallel one's A is split with its input and B replicated."""
    shapes, replicated, split = lora_module_shapes(arch), 0, 0
    for m in (m for m in modules if m in shapes):  # a module the model lacks is refused (lora_checks.py)
        a, b = rank * shapes[m][0], rank * shapes[m][1]
        replicated, split = (replicated + a, split + b) if _COLUMN_PARALLEL[m] else (replicated + b, split + a)
    return replicated, split


def lora_params(arch: ArchSpec, rank: int, modules: tuple[str, ...]) -> int:
    """Adapter parameters of the whole model (the trainable ones under LoRA), the experts' included."""
    return sum(lora_stage_params(arch, rank, modules, 0, arch.num_layers))


def lora_params_per_gpu(arch: ArchSpec, rank: int, modules: tuple[str, ...], *, tp: int, pp: int, ep: int = 1) -> float:
    """Adapter parameters one GPU holds on the heaviest stage: its layers' replicated ones, the
    split ones / tp, and its experts' / ep (each EP rank holds num_experts / ep experts, whole)."""
    return sum(_lora_stage_per_gpu(arch, rank, modules, tp=tp, pp=pp, ep=ep))


def lora_expert_params_per_gpu(arch: ArchSpec, rank: int, modules: tuple[str, ...], *, tp: int, pp: int, ep: int = 1) -> float:
    """The experts' share of :func:`lora_params_per_gpu` (the distributed optimizer shards it over
    the expert-data-parallel group, not over dp)."""
    return _lora_stage_per_gpu(arch, rank, modules, tp=tp, pp=pp, ep=ep)[1]


def _lora_stage_per_gpu(arch: ArchSpec, rank: int, modules: tuple[str, ...], *, tp: int, pp: int, ep: int) -> tuple[float, float]:
    """(non-expert, expert) adapter parameters per GPU of the heaviest stage (as stage_param_split cuts layers)."""
    per_stage, stages = arch.num_layers // pp, []
    for s in range(pp):
        replicated, split, experts = lora_stage_params(arch, rank, modules, s * per_stage, (s + 1) * per_stage)
        stages.append((replicated + split / tp, experts / ep))
    return max(stages, key=sum)


def activation_bytes_per_token(arch: ArchSpec, tp: int, sequence_parallel: bool, dtype_bytes: int = 2) -> float:
    """Bytes kept for backward per token per dense layer.

    TP-sharded: q/k/v, attention output, fc1 (gate and up) and its activation output.
    Not sharded unless sequence parallel: residual input, the two norm outputs, the
    attention-block output. Plus fp32 norm statistics (negligible, ignored).
    """
    f = arch.ffn_hidden_size
    return _attention_bytes_per_token(arch, tp, sequence_parallel, dtype_bytes) + dtype_bytes * 3 * f / tp


def moe_activation_bytes_per_token(arch: ArchSpec, tp: int, sequence_parallel: bool, etp: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes kept for backward per token per MoE layer: the attention block's (as a dense layer's),
    then, for the tokens this rank routes (1/tp of them under sequence parallelism), the router's
    fp32 logits and probabilities [num_experts each], the dispatcher's permuted copies of the
    token going in and coming out of its top-k experts [k x hidden each], and in each expert fc1
    (gate and up) and its activation output [k x 3 x moe_ffn / etp]. Routing is taken as
    balanced: an expert that draws more than its share of tokens holds more."""
    k, f = arch.experts_per_token, arch.moe_ffn_hidden_size
    routed = 8 * arch.num_experts + dtype_bytes * (2 * k * arch.hidden_size + 3 * k * f / etp)
    shared = dtype_bytes * 3 * arch.num_shared_experts * f / tp  # every token's shared experts: a TP-split SwiGLU
    return _attention_bytes_per_token(arch, tp, sequence_parallel, dtype_bytes) + routed / (tp if sequence_parallel else 1) + shared


def _attention_bytes_per_token(arch: ArchSpec, tp: int, sequence_parallel: bool, dtype_bytes: int) -> float:
    """q, k, v and the attention output (TP-split), the residual, two norm outputs and the block's
    output (split only under sequence parallelism); multi-latent attention's keys are per head
    (up-projected from the latent) and its q and kv latents are kept whole."""
    h = arch.hidden_size
    q_dim = arch.num_heads * arch.qk_head_dim
    k_dim, v_dim = (arch.num_heads * arch.qk_head_dim, arch.num_heads * arch.v_dim) if arch.is_mla else (
        arch.num_kv_heads * arch.kv_channels, arch.num_kv_heads * arch.kv_channels)  # fmt: skip
    out_dim = arch.num_heads * arch.v_dim
    replicated: float = 4 * h  # divided by tp below
    if sequence_parallel:
        replicated /= tp
    latents = (arch.q_lora_rank or 0) + (arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0) if arch.is_mla else 0
    return dtype_bytes * ((q_dim + k_dim + v_dim + out_dim) / tp + replicated + latents)


def _activations(arch: ArchSpec, tokens: int, *, tp: int, etp: int, sp: bool, recompute: str, wbytes: int) -> float:
    """Activations of stage 0 under 1F1B (layers/pp x pp micro-batches = num_layers layers' worth);
    full recompute keeps each layer's input plus one layer's own during its backward."""
    moe = arch.num_moe_layers
    per_layer = {"dense": activation_bytes_per_token(arch, tp, sp, wbytes)} if moe < arch.num_layers else {}
    if moe:
        per_layer["moe"] = moe_activation_bytes_per_token(arch, tp, sp, etp, wbytes)
    if recompute == "full":
        return tokens * arch.num_layers * arch.hidden_size * wbytes / (tp if sp else 1) + tokens * max(per_layer.values())
    return tokens * ((arch.num_layers - moe) * per_layer.get("dense", 0.0) + moe * per_layer.get("moe", 0.0))


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
    ep: int = 1,
    etp: int = 1,
    lora_params: float | None = None,
    lora_expert_params: float = 0.0,
    forward_tokens_per_micro_batch: int | None = None,
) -> TrainMemory:
    """``lora_params``: the adapter parameters per GPU (:func:`lora_params_per_gpu`) when the
    base model is frozen under LoRA; None = full fine-tuning. ``lora_expert_params``: the experts'
    share of them (:func:`lora_expert_params_per_gpu`). ``forward_tokens_per_micro_batch``: the
    forward-only passes' micro-batches (actor.logprob_*) when not the update's."""
    dense, experts = stage_params_per_gpu(arch, tp=tp, pp=pp, ep=ep, etp=etp, value_head=value_head)
    params = dense + experts
    # The distributed optimizer shards each parameter's state over the ranks holding the same
    # shard: the dense ones over dp, the experts over the expert-data-parallel size tp x dp / (ep x etp).
    sharded = dense / dp + experts * ep * etp / (tp * dp) if distributed_optimizer else params
    trained = params
    if lora_params is not None:  # only the adapters have grads and optimizer state
        params, trained = params + lora_params, lora_params
        adapters = lora_params - lora_expert_params
        sharded = adapters / dp + lora_expert_params * ep * etp / (tp * dp) if distributed_optimizer else lora_params
    wbytes = DTYPE_BYTES[dtype]
    act = 0.0
    if trainable:
        act = _activations(arch, tokens_per_micro_batch, tp=tp, etp=etp, sp=sequence_parallel, recompute=recompute, wbytes=wbytes)
    def head(tokens: int) -> float:
        """The LM head's fp32 chunk buffers (the value head's outputs) of a micro-batch of ``tokens``."""
        return 2 * 4 * tokens if value_head else 4 * 4 * min(logprob_chunk_tokens, tokens) * arch.vocab_size / tp

    logits = head(tokens_per_micro_batch)
    if value_head:
        head_grad = 0.0
    else:
        # Several chunks sum in fp32, then cast: both copies exist for a moment.
        grad_bytes = 4 + (wbytes if wbytes != 4 else 0) if tokens_per_micro_batch > logprob_chunk_tokens else wbytes
        frozen_head = lora_params is not None  # LoRA freezes the output layer: no gradient of it
        head_grad = grad_bytes * arch.vocab_size / tp * arch.hidden_size if trainable and not frozen_head else 0.0
    master = 0 if wbytes == 4 else 4  # fp32 weights are their own master copy
    return TrainMemory(
        weights=wbytes * params,
        grads=4 * trained if trainable else 0.0,
        optimizer=(master + 8) * sharded if trainable else 0.0,
        optimizer_at_build=master * sharded if trainable else 0.0,
        activations=act,
        logits=logits,
        head_grad=head_grad,
        forward_logits=None if forward_tokens_per_micro_batch is None else head(forward_tokens_per_micro_batch),
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
    """K and V of every layer for one token on one engine rank. Multi-latent attention caches the
    compressed latent and the shared rope key instead (SGLang's MLA pool: kv_lora_rank +
    qk_rope_head_dim per layer), whole on every TP rank."""
    if arch.is_mla:
        return arch.num_layers * ((arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0)) * DTYPE_BYTES[dtype]
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
    attention = [heads * d * h, 2 * kv * d * h]
    if arch.is_mla:  # q up (or q), kv up, output projections
        attention = [(arch.q_lora_rank or h) * heads * arch.qk_head_dim,
                     (arch.kv_lora_rank or 0) * heads * ((arch.qk_nope_head_dim or 0) + arch.v_dim), heads * arch.v_dim * h]  # fmt: skip
    return DTYPE_BYTES[dtype] * max(arch.vocab_size * h, arch.ffn_hidden_size * h, *attention)


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
        out |= {POLICY_FORWARD: policy.forward_working, REFERENCE_FORWARD: policy.forward_working,
                POLICY_UPDATE: policy.update_working}
    if critic is not None:
        out |= {CRITIC_FORWARD: critic.forward_working, CRITIC_UPDATE: critic.update_working}
    return out
