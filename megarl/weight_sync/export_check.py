"""Weight fingerprints: is what a push exported exactly what the policy holds?

The post-push log-prob check (megarl/weight_sync/logprob_check.py) sees the engine end to end, but
in bf16 its noise floor hides small errors: one matrix scaled by 1.01 moves the probe's
log-probs about as much as bf16 rounding does. This check is exact and cheap. For every group of
HF tensors one Megatron parameter holds (q/k/v of a fused QKV, gate/up of fc1, or one tensor), it
compares two permutation-invariant statistics, the fp64 sum and the fp64 sum of magnitudes:

- expected: from the policy's own parameters, shard by shard (the vocabulary padding rows left
  out, a replicated tensor counted on TP rank 0 only), summed over the TP group and collected
  over the pipeline stages whose tensors the export delivers to this rank;
- observed: from the tensors the export actually yielded, as the weight stream packs them.

The two paths share nothing but the parameters: a conversion that scales, truncates, drops or
mixes up tensors between parameters, or a pipeline broadcast that delivers the wrong bytes,
shows up as a mismatch. What sums cannot see (a permutation inside one group, such as q and k
swapped) changes the computation and is the log-prob probe's to catch.

Exported values are the parameters' own (same dtype, no arithmetic), so both sums add the same
numbers in a different order: they agree to about 1e-15 of the magnitude sum; the bound below
leaves a wide margin and is still 10^4 times tighter than a 1 % change of one tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megarl.parallel.stage_collection import Collect

Stats = tuple[float, float]  # (sum, sum of |x|), fp64
Fingerprint = dict[tuple[str, ...], Stats]  # HF names of one parameter -> its stats
REL_TOL = 1e-6
_CHUNK = 1 << 24  # elements per fp64 chunk: the temporaries (the chunk, its |x|) stay under 256 MiB


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """``[2]`` fp64: (sum, sum of |x|) of ``t``, accumulated in fp64 chunk by chunk."""
    out = torch.zeros(2, dtype=torch.float64, device=t.device)
    for chunk in t.detach().reshape(-1).split(_CHUNK):
        wide = chunk.to(torch.float64)
        out[0] += wide.sum()
        out[1] += wide.abs().sum()
    return out


def expected_fingerprint(bridge: Any, model: torch.nn.Module, *, collect: Collect = "all") -> Fingerprint:
    """The fingerprint of what ``bridge.export_hf_tensors(model, collect=...)`` yields on this
    rank, computed from the parameters (a collective over the TP group, and the PP group unless
    ``collect`` is "stage": every rank of the replica calls it at the same point)."""
    import torch.distributed as dist

    from megarl.models.bridge import hf_config_of, unwrap_model
    from megarl.models.lora import lora_of
    from megarl.parallel.sharding import all_gather_objects, pp_group, tp_group
    from megarl.parallel.stage_collection import receives_all

    gpt = unwrap_model(model)
    hf_config = hf_config_of(gpt)
    info = bridge.shard_info(hf_config, gpt)
    rules = [(rule, param) for rule, param in bridge.local_rules(gpt) if rule.export]
    lora = lora_of(gpt)
    mine = [(rule, param) for rule, param in rules if not rule.expert]
    device = next(gpt.parameters()).device
    stats = torch.zeros(len(mine), 2, dtype=torch.float64, device=device)  # [params, (sum, abs)]
    for i, (rule, param) in enumerate(mine):
        if rule.layout == "replicated" and info.tp_rank != 0:
            continue  # every TP rank holds it: count it once
        values = param.detach() if lora is None else lora.merged(param)  # what the export yields
        if rule.layout == "vocab":  # rows at and past the true vocabulary are padding, never exported
            first = info.tp_rank * values.shape[0]
            values = values[: max(0, min(values.shape[0], info.vocab_size - first))]
        stats[i] = tensor_stats(values)
    if info.tp_size > 1:
        dist.all_reduce(stats, group=tp_group())
    local = {rule.hf: (float(s), float(a)) for (rule, _), (s, a) in zip(mine, stats.cpu().tolist(), strict=True)}
    local |= _expert_fingerprint([(rule, param if lora is None else lora.merged(param)) for rule, param in rules if rule.expert])
    pp_size = dist.get_world_size(pp_group())
    if collect == "stage" or pp_size == 1:
        return local
    stages = all_gather_objects(local)  # on every rank of the PP group, the leader's included
    if not receives_all(collect, dist.get_rank(pp_group()), info.tp_rank, pp_size):
        return local
    merged: Fingerprint = {}
    for stage in stages:
        merged |= stage
    return merged


def _expert_fingerprint(experts: list[tuple[Any, torch.Tensor]]) -> Fingerprint:
    """The stats of this stage's experts (as exported: with their LoRA adapters merged) on every
    EP rank, as the export gathers them over the expert-parallel group. A TP rank's copy of an
    expert is not a TP shard (no sum over TP); at etp > 1 it is an expert-tensor-parallel shard,
    summed over that group. Collective over the ETP and EP groups (size 1 for dense models, where
    ``experts`` is empty)."""
    import torch.distributed as dist

    from megarl.parallel.sharding import all_gather_objects, ep_group, etp_group

    if not experts:
        return {}
    stats = torch.stack([tensor_stats(param) for _, param in experts])  # [experts, (sum, abs)]
    if dist.get_world_size(etp_group()) > 1:
        dist.all_reduce(stats, group=etp_group())
    local = {rule.hf: (float(s), float(a)) for (rule, _), (s, a) in zip(experts, stats.cpu().tolist(), strict=True)}
    if dist.get_world_size(ep_group()) == 1:
        return local
    merged: Fingerprint = {}
    for rank in all_gather_objects(local, group=ep_group()):
        merged |= rank
    return merged


class WeightExportError(RuntimeError):
    """A push exported tensors that differ from the policy's parameters (a megarl bug)."""


class ExportCheck:
    """The fingerprint check of one policy rank's pushes: the weight stream opens an
    :class:`Observation` per push (:meth:`observe`), and after the push, failed or not, every
    rank asks for the verdict (:meth:`verdict`), which raises on all of them or on none.

    Built on every rank of the policy at the same point (it makes a gloo group: the verdict's
    gather must not open a world-wide NCCL communicator in the middle of a colocated push)."""

    def __init__(self, bridge: Any, model: torch.nn.Module) -> None:
        import torch.distributed as dist

        self.bridge, self.model = bridge, model
        self.problems: list[str] = []
        self.open = 0  # observations started and not finished (a consumer that stopped early)
        initialized = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if initialized and dist.get_world_size() > 1 else None

    def observe(self, *, collect: Collect) -> Observation:
        """Start observing one export (the expected side is a collective: see expected_fingerprint)."""
        self.open += 1
        return Observation(expected_fingerprint(self.bridge, self.model, collect=collect), self)

    def verdict(self, version: int, failure: BaseException | None = None) -> None:
        """After push ``version`` on every rank (a collective): raises when any rank's export
        differed, or, on the ranks whose push went through, when another rank's push failed
        (``failure``: this rank's own error, which its caller raises)."""
        mine = (self.problems + (["the export was not read to its end"] if self.open and failure is None else []),
                None if failure is None else f"{type(failure).__name__}: {failure}")  # fmt: skip
        self.problems, self.open = [], 0
        everyone = self._gather(mine)
        failed = [(rank, error) for rank, (_, error) in enumerate(everyone) if error is not None]
        if failed and failure is None:
            raise WeightExportError(f"weight push {version} failed on policy rank(s) {[r for r, _ in failed]}: "
                                    f"{failed[0][1]}")  # fmt: skip
        problems = sorted({p for ps, _ in everyone for p in ps})
        if problems and not failed:
            raise WeightExportError(
                f"weight push {version}: {len(problems)} exported tensor(s) differ from the policy's parameters "
                f"(a bridge conversion or transfer bug; please report it): {'; '.join(problems[:3])}"
                + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            )

    def _gather(self, mine: Any) -> list[Any]:
        import torch.distributed as dist

        if self.group is None:
            return [mine]
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone


class Observation:
    """The stats of the tensors one export yielded, compared with the expected at the end."""

    def __init__(self, expected: Fingerprint, check: ExportCheck) -> None:
        self.expected, self.check = expected, check
        self.by_name: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.by_name[name] = tensor_stats(tensor)

    def finish(self) -> None:
        self.check.problems += self.mismatches()
        self.check.open -= 1

    def mismatches(self) -> list[str]:
        """One line per parameter whose exported tensors do not add up to its own values, and per
        exported tensor no parameter holds."""
        problems = []
        for names, (want_sum, want_abs) in self.expected.items():
            missing = [n for n in names if n not in self.by_name]
            if missing:
                problems.append(f"{', '.join(missing)}: never exported")
                continue
            got_sum, got_abs = (float(x) for x in sum((self.by_name[n].cpu() for n in names), torch.zeros(2, dtype=torch.float64)))
            tol = REL_TOL * max(want_abs, got_abs, 1e-30)
            if abs(got_sum - want_sum) > tol or abs(got_abs - want_abs) > tol:
                problems.append(f"{'+'.join(names)}: sum {got_sum:.9g} and sum |x| {got_abs:.9g} exported, "
                                f"{want_sum:.9g} and {want_abs:.9g} in the policy")  # fmt: skip
        known = {n for names in self.expected for n in names}
        problems += [f"{n}: exported but no parameter holds it" for n in self.by_name if n not in known]
        return problems
