"""One Megatron model in a worker process: build it, run batches through Megatron's schedule.

Shared by the policy, reference and critic workers. A :class:`MegatronModel` owns one
``GPTModel`` (this rank's TP shard of this rank's PP stage), built and loaded from an HF
directory through the model bridge. Its two entry points:

- :meth:`MegatronModel.forward_tokens` runs a whole batch forward-only and returns per-token
  results (log-probs / entropy / values) of the rows this rank computed
  (:class:`~megarl.data.batch.TokenRows`, assembled on the controller);
- :meth:`MegatronModel.forward_backward` runs one mini-batch forward and backward with a loss
  function; gradients are normalised globally (see below); the loss metrics accumulate on the
  device and :meth:`MegatronModel.reduce_metrics` reduces them to every rank.

Conventions (identical for all workers):

- Every rank of the worker group is handed the SAME whole batch. Each DP replica takes its
  share by index (``balanced_partition`` by token count) and cuts it into micro-batches. The
  replica's output rank (last pipeline stage, TP rank 0) returns its rows; nothing per-token
  is reduced over the world. Positions past a row's response length are 0.
- Normalisation is global: the schedule runs with ``calculate_per_token_loss=True``; a loss
  function returns a SUM and its count; Megatron adds the counts over micro-batches and DP
  ranks and divides the (summed, not averaged) DP gradient by that total once.
- Only the real response tokens reach the output layer: a forward pre-hook on ``output_layer``
  keeps the hidden states at the positions that predict them (``[S, b, h] -> [n, 1, h]``, see
  :class:`ResponsePositions`). Prompt and padding positions never pay for the LM head.
- The LM head's logits are never built whole: the policy's and reference's output layer hands
  the hidden states through (the last stage returns ``[1, n, h]``), and the log-prob head
  computes the output layer's matmul and the log-softmax together, ``logprob_chunk_tokens``
  tokens at a time (``megarl.megatron_runtime.logprobs``). The critic's value head
  runs as a layer (``[1, n, 1]`` values). Heads put their per-token results back in
  ``[b, R]`` rows (``MicroBatch.to_rows``).
- Several models may live in one process (policy + reference): Megatron's parallel state is
  process-global, so :func:`ensure_parallel` initialises it once and later models check that
  their layout matches.

Sequence parallelism (``tcfg.sequence_parallel``, resolved from the config: on when TP > 1):
each micro-batch's width is rounded up to a multiple of TP, Megatron splits the sequence over
the TP ranks between the tensor-parallel layers, and the position hook gathers it back before
the output layer.

Packed micro-batches (``actor.pack_sequences``, the default): a micro-batch is one sequence
``[1, T]`` of its rows end to end, handed to Megatron as THD with packed-sequence parameters
(``megarl.models.attention.packed_seq_params``); the position hook's rows are then all 0 and
its columns offsets into the packed sequence, so the heads work unchanged. In training every DP
replica runs as many micro-batches as the busiest (fillers with loss weight 0,
``micro_batches.equal_counts``).

Routing replay (MoE models, ``actor.moe.routing_replay`` not none): ``routing`` holds this
model's own hooks on its routers (``megarl.megatron_runtime.routing_replay``); each micro-batch
hands them its rows' engine routing before the model runs, in every forward and training run,
so the policy and the reference (same process) each replay only what their own batch carries.

Left out: virtual pipeline stages, context parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megarl.algos.metrics import MetricAccumulator
from megarl.config.train_sections import ActorConfig, ParallelConfig
from megarl.data.batch import Batch, TokenRows
from megarl.megatron_runtime.logprobs import linear_logprobs
from megarl.megatron_runtime.micro_batches import (
    MicroBatch,
    MicroBatching,
    equal_counts,
    pack_micro_batch,
    sequence_lengths,
)
from megarl.megatron_runtime.routing_replay import RoutingReplay

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A head turns the last stage's output [1, n, ...] (the n real response tokens) for one
# micro-batch into named per-token tensors [b, R] (on every TP rank of the stage; TP rank 0's
# copy is kept).
Head = Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]]


def ensure_parallel(parallel: ParallelConfig, seed: int) -> Any:
    """Initialise Megatron's groups for ``parallel`` once per process; later calls must match."""
    from megatron.core import parallel_state

    from megarl.parallel.groups import current_parallel_info, init_parallel

    for name in ("vpp", "cp"):
        if getattr(parallel, name) != 1:
            raise ValueError(f"parallel.{name}={getattr(parallel, name)} is not supported yet; set it to 1")
    if not parallel_state.model_parallel_is_initialized():
        return init_parallel(parallel.tp, parallel.pp, seed, ep=parallel.ep, etp=parallel.etp)
    info = current_parallel_info()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if (info.tp_size, info.pp_size, info.ep_size, etp) != (parallel.tp, parallel.pp, parallel.ep, parallel.etp):
        raise ValueError(
            f"this process already runs a model with tp={info.tp_size}, pp={info.pp_size}, ep={info.ep_size}, "
            f"etp={etp}; a second model here must use the same layout, got tp={parallel.tp}, pp={parallel.pp}, "
            f"ep={parallel.ep}, etp={parallel.etp} (the reference shares the policy's layout: set it equal)"
        )
    return info


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class MegatronModel:
    """This rank's piece of one model plus what is needed to run it (see module docstring)."""

    bridge: Any
    hf_config: Any
    tcfg: Any  # megatron TransformerConfig (calculate_per_token_loss=True)
    module: Any  # megatron GPTModel, or DDP(GPTModel) once wrapped for training
    info: Any  # megarl.parallel.groups.ParallelInfo
    vocab_size: int  # real vocabulary (padding columns past it are masked)
    positions: ResponsePositions  # the output layer's position selector (last stage)
    logprob_chunk_tokens: int  # tokens whose LM-head logits exist at once
    layer_spec: str  # "local" or "te" (megarl.models.layer_specs), as built
    flex_attention: bool  # packed micro-batches attend through FlexAttention (actor.packed_attention, local spec)
    routing: RoutingReplay | None = None  # the routers' replay of the engine's routing (actor.moe.routing_replay)

    @classmethod
    def build(
        cls,
        hf_path: str,
        cfg: ActorConfig,
        dtype: torch.dtype,
        seed: int,
        *,
        value_head: bool = False,
        progress: Callable[[int, int], None] | None = None,
        layer_spec: str = "local",
        load_weights: bool = True,
    ) -> MegatronModel:
        """Build this rank's shard through the bridge and load the weights of ``hf_path`` into it:
        an HF directory (``progress(done, total)`` after each parameter), or a model checkpoint of
        `megarl convert hf-to-megatron`. ``layer_spec`` is ``model.layer_spec``
        (``megarl.models.layer_specs``). ``load_weights=False``: the shard as initialised, for a
        caller that fills every parameter itself (an export of a training checkpoint)."""
        from transformers import AutoConfig

        from megarl.parallel.mcore_version import require_megatron_core

        require_megatron_core()  # before the first megatron import: a one-line error, not a deep one
        from megarl.checkpoint.model_checkpoint import is_model_checkpoint, load_model_weights
        from megarl.models.bridges import get_bridge
        from megarl.models.layer_specs import resolve_layer_spec

        info = ensure_parallel(cfg.parallel, seed)
        hf_config = AutoConfig.from_pretrained(hf_path)
        bridge = get_bridge(hf_config)
        spec = resolve_layer_spec(layer_spec, torch.device(info.device).type)  # the config depends on it (rope fusion)
        tcfg = bridge.transformer_config(hf_config, cfg.parallel, dtype, cfg.recompute, spec=spec, moe=cfg.moe)
        _configure_schedule(tcfg, dtype)
        module = bridge.build_model(
            hf_config, tcfg, pre_process=info.is_first_stage, post_process=info.is_last_stage, value_head=value_head,
            spec=spec,
        )
        if load_weights and is_model_checkpoint(hf_path):  # `megarl convert hf-to-megatron` output, any layout
            load_model_weights(module, hf_path)
        elif load_weights:
            bridge.load_hf_weights(module, hf_path, progress)
        if cfg.lora is not None and not value_head:  # after the load: the base weights are frozen as loaded
            from megarl.models.lora import attach_lora, inputs_need_grad

            attach_lora(module, cfg.lora, seed)
            if info.is_first_stage:
                module.embedding.register_forward_hook(inputs_need_grad)
        positions = ResponsePositions(tcfg.sequence_parallel)
        if info.is_last_stage:
            module.output_layer.register_forward_pre_hook(positions, with_kwargs=True)
            if not value_head:  # the log-prob head computes the logits, in chunks
                module.output_layer.forward = _hidden_states_through
        vocab = bridge.vocab_size(hf_config)
        flex = cfg.packed_attention == "flex" and spec == "local"  # TE's own attention takes THD under te
        routing = RoutingReplay.attach(module, tcfg, cfg.moe.routing_replay, info.tp_rank, info.tp_size)
        return cls(bridge, hf_config, tcfg, module, info, vocab, positions, cfg.logprob_chunk_tokens, spec, flex, routing)

    @property
    def core(self) -> Any:
        """The GPTModel itself (unwrapped from DDP; megatron's, untyped)."""
        return getattr(self.module, "module", self.module)

    def output_weight(self) -> torch.Tensor:
        """``[V/tp, h]`` the weight GPTModel would hand its output layer (the word embeddings
        when they are tied and this stage holds them)."""
        core = self.core
        if core.share_embeddings_and_output_weights:
            return core.shared_embedding_or_output_weight()
        return core.output_layer.weight

    # ---- forward only ---------------------------------------------------------------------
    def forward_tokens(self, batch: Batch, head: Head, batching: MicroBatching) -> TokenRows | None:
        """Run ``batch`` forward-only (collective). The output rank of each DP replica (last
        pipeline stage, TP rank 0) returns the rows its replica computed, the others None."""
        results: list[tuple[MicroBatch, dict[str, torch.Tensor]]] = []

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            if not mb.filler:
                results.append((mb, {k: v.detach() for k, v in head(mb, output).items()}))
            return output.new_zeros(()), output.new_zeros((), dtype=torch.int), {}  # no host-to-device copy

        self.module.eval()
        with torch.no_grad():
            self._run(batch, batching, loss_func, forward_only=True)
        if not (self.info.is_last_stage and self.info.tp_rank == 0):
            return None
        names = list(results[0][1])
        values = {name: torch.cat([v[name].float() for _, v in results]).cpu() for name in names}  # [n, R]
        return TokenRows(rows=torch.cat([mb.rows for mb, _ in results]).cpu(), values=values)

    # ---- training -------------------------------------------------------------------------
    def forward_backward(
        self,
        mini_batch: Batch,
        loss_head: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]],
        metrics: MetricAccumulator,
        batching: MicroBatching,
        stage_output: Callable[[MicroBatch, torch.Tensor], None] | None = None,
    ) -> None:
        """Forward + backward of this replica's share of ``mini_batch``; grads are left in the
        DDP buffers, normalised by the global count. Each micro-batch's loss metrics are added
        to ``metrics`` on the device (this rank's share, last pipeline stage only; no host sync):
        :meth:`reduce_metrics` makes them the group's. ``stage_output`` sees each micro-batch's
        output of this pipeline stage (on every stage) before it leaves the forward step."""
        counts = WholeCounts(self.info.device)

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            loss_sum, count, slice_metrics = loss_head(mb, output)
            if mb.filler:  # weight 0, through the real head: every parameter still gets its (zero) gradient
                return loss_sum * 0, counts.as_int(0), {}
            metrics.add(slice_metrics)
            return loss_sum, counts.as_int(count), {}

        self.module.train()
        self._run(mini_batch, batching, loss_func, forward_only=False, stage_output=stage_output)
        counts.check()

    # ---- internals ------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch, batching: MicroBatching, *, even: bool) -> list[MicroBatch]:
        """This DP replica's micro-batches of ``batch``; ``even``: as many as the busiest
        replica's (training: see ``micro_batches.equal_counts``)."""
        replicas = batching.replica_groups(batch, self.info.dp_size)
        if even:
            groups, fillers = equal_counts(replicas, self.info.dp_rank, sequence_lengths(batch).tolist())
        else:  # a forward pass of a dense model has no collective over DP at all
            groups, fillers = replicas[self.info.dp_rank], 0
        multiple = self.info.tp_size if self.tcfg.sequence_parallel else 1
        return [
            pack_micro_batch(batch, rows, self.info.device, multiple, packed=batching.packed,
                             filler=k < fillers)  # fmt: skip
            for k, rows in enumerate(groups)
        ]

    def _run(self, batch: Batch, batching: MicroBatching, loss_func: Callable, *, forward_only: bool,
             stage_output: Callable[[MicroBatch, torch.Tensor], None] | None = None) -> None:  # fmt: skip
        """Drive Megatron's schedule (1F1B under PP) over this replica's micro-batches of ``batch``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Each MoE layer of each micro-batch is an all-to-all over the expert-parallel group, which
        # may span DP replicas: with ep > 1 a forward pass keeps the replicas in step too.
        micro = self._micro_batches(batch, batching, even=not forward_only or self.info.ep_size > 1)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.routing is not None:
                self.routing.install(mb)
            output = self._forward(model, mb)
            if stage_output is not None:
                stage_output(mb, output)
            return output, partial(loss_func, mb)

        with self.routing.run(training=not forward_only) if self.routing is not None else nullcontext():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[self.module],
                num_microbatches=len(micro),
                seq_length=max(mb.tokens.shape[1] for mb in micro),  # only a hint: variable_seq_lengths makes PP send shapes
                micro_batch_size=max(mb.tokens.shape[0] for mb in micro),
                forward_only=forward_only,
            )

    def _forward(self, module: Any, mb: MicroBatch) -> torch.Tensor:
        """``module`` (this model, wrapped or not) on micro-batch ``mb``: this stage's output."""
        from megarl.models.attention import packed_seq_params

        self.positions.rows, self.positions.columns = mb.token_rows, mb.token_columns
        # Padded rows are left-aligned: plain causal attention (mask None) is exact; packed
        # rows are kept apart by the attention, told by the packed-sequence parameters.
        params = None if mb.layout is None else packed_seq_params(mb.layout, host_offsets=self.layer_spec == "local",
                                                                   flex=self.flex_attention)  # fmt: skip
        return module(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None, packed_seq_params=params)

    def forward_micro_batch(self, mb: MicroBatch, head: Head) -> dict[str, torch.Tensor]:
        """``head``'s values of one micro-batch another model packed (its update's), forward only
        and without a schedule: one pipeline stage (pp 1) and no routing replay only. The values
        are those :meth:`forward_tokens` gives for the same rows in the same micro-batch."""
        assert self.info.pp_size == 1 and self.routing is None, "a micro-batch forward runs the whole model in one stage"
        self.module.eval()
        with torch.no_grad():
            return {k: v.detach() for k, v in head(mb, self._forward(self.module, mb)).items()}

    def reduce_metrics(self, metrics: MetricAccumulator, replicated: dict[str, torch.Tensor] | None = None) -> None:
        """Make ``metrics`` the group's, in place on the device, identical on every rank: one
        SUM and one MAX all-reduce over the DP group; then ``replicated`` (values every rank of
        the last stage holds alike, e.g. the optimizer's) is added on the last stage; then one
        broadcast hands the last stage's state to the other pipeline stages (their own loss
        functions never ran)."""
        from megatron.core import parallel_state as ps

        if self.info.dp_size > 1:
            dp_group = ps.get_data_parallel_group()
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
            metrics.all_reduce(lambda t, op: dist.all_reduce(t, op=ops[op], group=dp_group))
        if self.info.is_last_stage and replicated:
            metrics.add(replicated)
        if self.info.pp_size > 1:
            src, pp_group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
            metrics.broadcast(lambda t: dist.broadcast(t, src=src, group=pp_group))


class ResponsePositions:
    """Forward pre-hook of the output layer: keep the hidden states of the real response tokens.

    ``rows [n]`` and ``columns [n]`` are set per micro-batch before the model runs; the hook
    turns the output layer's input ``[S, b, h]`` into ``[n, 1, h]`` (an index, so gradients
    flow back to exactly those positions).

    Under sequence parallelism the input is this rank's ``[S/tp, b, h]`` slice: it is gathered
    first, with a backward that only splits the gradient (no sum), because both heads hand
    back a full, already summed gradient of their input: the log-prob head all-reduces it over
    TP itself (for the n selected tokens only), and the value head is replicated."""

    def __init__(self, sequence_parallel: bool = False) -> None:
        self.sequence_parallel = sequence_parallel
        self.rows: torch.Tensor | None = None  # [n] long
        self.columns: torch.Tensor | None = None  # [n] long

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        hidden = args[0]  # [S, b, h], or [S/tp, b, h] under sequence parallelism
        if self.sequence_parallel:  # whole sequences out of the model, positions chosen or not
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)  # [S, b, h]
        if self.columns is not None:
            hidden = hidden[self.columns, self.rows].unsqueeze(1)  # [n, 1, h]
        return (hidden, *args[1:]), kwargs


def _hidden_states_through(hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
    """The LM output layer's forward, replaced: the hidden states go on unchanged (GPTModel
    returns them as ``[1, n, h]``) and the log-prob head applies the weight in chunks."""
    return hidden, None


def _configure_schedule(tcfg: Any, dtype: torch.dtype) -> None:
    """Schedule flags every worker relies on (see the module docstring)."""
    from megatron.core.distributed import finalize_model_grads

    tcfg.calculate_per_token_loss = True
    tcfg.variable_seq_lengths = True  # micro-batches differ in width; PP exchanges shapes
    tcfg.finalize_model_grads_func = finalize_model_grads
    if getattr(tcfg, "pipeline_dtype", None) is None:
        tcfg.pipeline_dtype = dtype


class WholeCounts:
    """Megatron adds the loss normalisers in an int tensor, so each micro-batch's count must be
    a whole number. The counts are rounded on the device and their largest distance from a
    whole number is kept there too: :meth:`check`, once per mini-batch, is the only host read
    (no sync inside a micro-batch)."""

    def __init__(self, device: torch.device) -> None:
        self.worst = torch.zeros((), dtype=torch.float64, device=device)

    def as_int(self, count: torch.Tensor | float) -> torch.Tensor:
        count = torch.as_tensor(count, dtype=torch.float64, device=self.worst.device)
        rounded = count.round()
        torch.maximum(self.worst, (count - rounded).abs(), out=self.worst)
        return rounded.to(torch.int)

    def check(self) -> None:
        worst = float(self.worst)
        if worst > 1e-6:
            raise ValueError(
                f"the loss function's normaliser_count must be a whole number of tokens or sequences "
                f"(Megatron adds it in an int tensor); one was {worst:.3g} away from one"
            )


def response_logprobs(
    model: MegatronModel, cfg: ActorConfig, batch: Batch, temperature: float, with_entropy: bool
) -> TokenRows | None:
    """``logprobs`` (and ``entropy``) ``[n, R]`` of the response rows this rank computed (see
    ``forward_tokens``), micro-batched as ``cfg``'s forward-only passes are
    (``MicroBatching.forward_only``: the forward the policy and the reference share)."""
    head = token_logprob_head(model, temperature, with_entropy)
    return model.forward_tokens(batch, head, MicroBatching.forward_only(cfg))


def token_logprob_head(
    model: MegatronModel, temperature: float, with_entropy: bool
) -> Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]]:
    """A head giving ``logprobs`` (and ``entropy``) ``[b, R]`` of the response tokens from the
    last hidden states of the real response tokens ``[1, n, h]``; positions past each
    response's length are 0."""
    from megarl.parallel.sharding import tp_group

    def head(mb: MicroBatch, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        weight = model.output_weight()  # [V/tp, h]
        logprobs, entropy = linear_logprobs(
            hidden[0],  # [n, h]
            weight,
            mb.token_targets(),
            temperature=temperature,
            vocab_start=model.info.tp_rank * weight.shape[0],
            vocab_size=model.vocab_size,
            group=tp_group() if model.info.tp_size > 1 else None,
            chunk_tokens=model.logprob_chunk_tokens,
            with_entropy=with_entropy,
        )
        out = {"logprobs": mb.to_rows(logprobs)}
        if entropy is not None:
            out["entropy"] = mb.to_rows(entropy)
        return out

    return head
