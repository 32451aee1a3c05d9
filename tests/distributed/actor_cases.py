"""Shared pieces of the Megatron worker tests: batches, a loss, and plain-HF references.

The references run HF transformers in one process with plain torch (no Megatron, no
process groups): per-row log-probs from the unpadded sequence, and an optimizer step with
torch's Adam on a globally normalised token-mean loss.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.algos.losses import ModelOutputs
from megarl.data.batch import Batch

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128)


def make_batch(seed: int, rows: int = 6, prompt_width: int = 7, response_width: int = 9, vocab: int = 259) -> Batch:
    """Left-padded prompts and right-padded responses of varied lengths; some in-response
    tokens are excluded from the loss (mask 0) to check masks are honoured."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, prompt_width + 1, (rows,), generator=g)
    rlen = torch.randint(1, response_width + 1, (rows,), generator=g)
    rlen[0] = response_width  # one full-width response
    return batch_of_lengths(plen.tolist(), rlen.tolist(), g, vocab, prompt_width, response_width)


def batch_of_lengths(
    prompt_lengths: list[int], response_lengths: list[int], g: torch.Generator, vocab: int = 259,
    prompt_width: int | None = None, response_width: int | None = None,
) -> Batch:  # fmt: skip
    """A batch whose rows have exactly these prompt and response lengths (random tokens from
    ``g``, advantages too; row 1's first response token is masked out of the loss)."""
    plen, rlen = torch.tensor(prompt_lengths), torch.tensor(response_lengths)
    rows = len(plen)
    prompt_width, response_width = prompt_width or int(plen.max()), response_width or int(rlen.max())
    prompt = torch.randint(0, vocab, (rows, prompt_width), generator=g)
    prompt_mask = (torch.arange(prompt_width)[None, :] >= prompt_width - plen[:, None]).long()
    prompt = prompt * prompt_mask
    valid = (torch.arange(response_width)[None, :] < rlen[:, None]).long()
    response = torch.randint(0, vocab, (rows, response_width), generator=g) * valid
    mask = valid.float()
    mask[1, 0] = 0.0  # e.g. a tool-output token inside a response
    return Batch(
        prompt_ids=prompt,
        prompt_mask=prompt_mask,
        response_ids=response,
        response_lengths=rlen,
        response_mask=mask,
        group_id=torch.arange(rows),
        advantages=torch.randn(rows, response_width, generator=g) * mask,
    )


def pg_loss(batch: Batch, outputs: ModelOutputs):
    """A token-mean policy-gradient loss: -sum(A * logp) / valid tokens (global count)."""
    mask = batch.response_mask.to(outputs.logprobs.dtype)
    loss_sum = -(batch.advantages.to(mask.dtype) * outputs.logprobs * mask).sum()
    count = mask.sum()
    metrics = {"actor/pg_loss": torch.stack([loss_sum.detach(), count])}
    # Metric names must be catalogued (megarl/metrics.py). To check the max reduction over
    # micro-batches, DP ranks and stages, a max-reduced name carries the largest loss-token log-prob.
    top = outputs.logprobs.detach().masked_fill(mask == 0, -torch.inf).max()
    metrics["actor/ratio_max"] = torch.stack([top, (count > 0).to(top.dtype)])
    if outputs.entropy is not None:
        metrics["actor/entropy"] = torch.stack([(outputs.entropy * mask).sum().detach(), count])
    return loss_sum, count, metrics


def mse_value_loss(batch: Batch, outputs: ModelOutputs):
    """0.5 * (V - returns)^2 summed over loss tokens, normalised by their count."""
    mask = batch.response_mask.to(outputs.values.dtype)
    err = (outputs.values - batch.returns.to(mask.dtype)) * mask
    loss_sum = 0.5 * (err**2).sum()
    count = mask.sum()
    return loss_sum, count, {"critic/vf_loss": torch.stack([loss_sum.detach(), count])}


def hf_model(path: str | Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model


def hf_token_logprobs(model, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row reference (logprobs, entropy) [B, R] from each row's unpadded sequence."""
    b, r = batch.response_ids.shape
    logprobs = torch.zeros(b, r)
    entropy = torch.zeros(b, r)
    for i in range(b):
        pl, rl = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        seq = torch.cat([batch.prompt_ids[i, batch.prompt_len - pl :], batch.response_ids[i, :rl]])
        logits = model(seq[None]).logits[0]  # [pl + rl, V]
        logp = torch.log_softmax(logits[pl - 1 : pl + rl - 1].float() / temperature, -1)  # [rl, V]
        logprobs[i, :rl] = logp.gather(-1, batch.response_ids[i, :rl, None])[:, 0]
        entropy[i, :rl] = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


def hf_reference_update(path: str | Path, batch: Batch, *, lr: float, clip_grad: float, mini_batch_size: int):
    """Plain-torch Adam steps of ``pg_loss`` on the HF model, one per mini-batch; returns the
    final state dict, the grad norm of each step (before clipping) and the largest loss-token
    log-prob seen."""
    model = hf_model(path)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    norms, logp_max = [], -torch.inf
    for mini in batch.split(mini_batch_size):
        opt.zero_grad()
        loss_sum, count = 0.0, 0.0
        for i in range(len(mini)):
            row = mini.select([i])
            lp, ent = _differentiable_row_logprobs(model, row)
            s, c, m = pg_loss(row, ModelOutputs(logprobs=lp, entropy=ent))
            logp_max = max(logp_max, float(m["actor/ratio_max"][0]))
            loss_sum, count = loss_sum + s, count + c
        (loss_sum / count).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, logp_max


def _differentiable_row_logprobs(model, row: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    pl, rl, r = int(row.prompt_lengths[0]), int(row.response_lengths[0]), row.response_len
    seq = torch.cat([row.prompt_ids[0, row.prompt_len - pl :], row.response_ids[0, :rl]])
    logits = model(seq[None]).logits[0]
    logp = torch.log_softmax(logits[pl - 1 : pl + rl - 1].float(), -1)
    lp = logp.gather(-1, row.response_ids[0, :rl, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    pad = torch.zeros(r - rl)
    return torch.cat([lp, pad])[None], torch.cat([ent, pad])[None]


def exported_state(worker) -> dict[str, torch.Tensor]:
    """The worker's weights as HF-named full tensors (a collective; every rank gets them)."""
    return {name: tensor.detach().float().cpu().clone() for name, tensor in worker.export_weights(gather_bytes=1 << 20)}


def gathered(rows, batch: Batch) -> dict[str, torch.Tensor]:
    """What the controller's client assembles from every rank's TokenRows, here on every rank
    (a collective: the test compares each rank's view)."""
    import torch.distributed as dist

    from megarl.data.batch import TokenRows

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    return TokenRows.assemble(parts, len(batch), batch.response_len)


def portable(obj):
    """Tensors -> numpy arrays, recursively: results that cross the spawn helper's queue must
    not hold torch tensors (their shared-memory pickling hangs when the sender exits)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def tensors(obj):
    """The inverse of :func:`portable` (numpy arrays -> tensors)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors(v) for v in obj)
    return obj


def optimized_params(optimizer) -> int:
    """How many of the model's parameters ``optimizer`` (Megatron's, chained or not) steps; the
    distributed optimizer's param_groups hold only the shards of this rank's slice of its gradient
    buffers, which hold every parameter it steps."""
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "model_param_gbuf_map"):
            total += sum(p.numel() for buffer in opt.buffers for p in buffer.params)
        else:
            total += sum(p.numel() for g in opt.param_groups for p in g["params"])
    return total


def lora_policy(path: str, cfg, adapters: dict, batch: Batch, temperature: float):
    """A LoRA policy (``cfg.lora``) with the full PEFT-named ``adapters`` loaded, and what it gives:
    ``(policy, its adapters, {logprobs, base: with the adapters off, merged: the export,
    optimized_ok: the optimizer holds the adapters alone, grads: of one backward of pg_loss})``."""
    from megarl.actors.policy import PolicyWorker
    from megarl.algos.losses import ModelOutputs
    from megarl.algos.metrics import MetricAccumulator
    from megarl.megatron_runtime.micro_batches import MicroBatching
    from megarl.megatron_runtime.model import token_logprob_head
    from megarl.models.lora import lora_of

    policy = PolicyWorker(path, cfg, "float32", seed=1)
    lora = lora_of(policy.model.core)
    lora.load_peft(adapters)
    out = {"logprobs": gathered(policy.compute_logprobs(batch, temperature), batch)["logprobs"]}
    with lora.disabled():
        out["base"] = gathered(policy.compute_logprobs(batch, temperature), batch)["logprobs"]
    out["merged"] = dict(policy.export_weights(gather_bytes=1 << 20))
    out["optimized_ok"] = optimized_params(policy.trainer.optimizer) == lora.trainable()
    head = token_logprob_head(policy.model, temperature, False)

    def loss_head(mb, hidden):
        return pg_loss(mb.batch, ModelOutputs(logprobs=head(mb, hidden)["logprobs"], entropy=None))

    policy.trainer.model.module.zero_grad_buffer()
    policy.trainer.model.forward_backward(batch, loss_head, MetricAccumulator(policy.info.device), MicroBatching.of(cfg))
    out["grads"] = lora.peft_tensors(grads=True)
    return policy, lora, out
