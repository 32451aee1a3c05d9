"""The metrics catalogue (megarl/metrics.py) is the one home of metric names: what the updates,
the advantage step, the rollout and the scorer emit is declared there, every name string in the
package is, and the metrics table of docs/metrics.md lists exactly the catalogue, reductions included."""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import Path

import pytest
import torch

from megarl.algos.kl import make_kl_controller
from megarl.algos.losses import ModelOutputs, make_policy_loss_fn, make_value_loss_fn
from megarl.algos.metrics import reduce_metrics
from megarl.algos.mismatch import mismatch_by_staleness
from megarl.algos.step import advantage_step
from megarl.config.algorithm_sections import AlgorithmConfig
from megarl.data.batch import Batch
from megarl.metrics import (
    CATALOGUE,
    UnknownMetricError,
    accumulated,
    lookup,
    optimizer_metric_names,
)
from megarl.rewards.scorer import ScoreResult
from megarl.rollout.collect import rollout_metrics

ROOT = Path(__file__).resolve().parents[2]


def _batch(**fields) -> Batch:
    """4 samples in 2 groups, responses of 3, 0, 2 and 1 tokens (one empty)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 2, 1])
    mask = (torch.arange(3)[None] < lengths[:, None]).float()
    base = dict(
        prompt_ids=torch.ones(4, 2, dtype=torch.long),
        prompt_mask=torch.ones(4, 2, dtype=torch.long),
        response_ids=torch.ones(4, 3, dtype=torch.long),
        response_lengths=lengths,
        response_mask=mask,
        group_id=torch.tensor([0, 0, 1, 1]),
        scores=torch.tensor([1.0, 0.0, 0.5, 0.5]),
        finish_reason=["stop", "length", "stop", "stop"],
        advantages=torch.randn(4, 3, generator=g) * mask,
        old_logprobs=-torch.rand(4, 3, generator=g),
        ref_logprobs=-torch.rand(4, 3, generator=g),
        rollout_logprobs=-torch.rand(4, 3, generator=g),
        values=torch.randn(4, 3, generator=g) * mask,
        returns=torch.randn(4, 3, generator=g) * mask,
    )
    base.update(fields)
    return Batch(**base)


def is_catalogued(name: str) -> bool:
    try:
        lookup(name)
    except UnknownMetricError:
        return False
    return True


def families() -> set[str]:
    """Every first path segment of the catalogue (what docs/metrics.md's table must cover)."""
    return {m.family for m in CATALOGUE}


def _emitted_by(role: str) -> set[str]:
    return {m.name for m in CATALOGUE if m.emitter == role} - set(optimizer_metric_names(role).values())


def test_every_policy_update_metric_is_catalogued_and_every_actor_entry_is_emitted():
    emitted: set[str] = set()
    for loss, tis, mis, entropy_coef, kl_in_loss, with_ref in itertools.product(
        ("ppo", "gspo"), ("none", "token", "sequence"), ("none", "geometric"), (0.0, 0.01), (True, False), (True, False)
    ):
        if kl_in_loss and not with_ref:
            continue
        cfg = AlgorithmConfig(policy_loss=loss, tis={"level": tis}, mis={"level": mis}, entropy_coef=entropy_coef,
                              kl={"use_in_loss": kl_in_loss})  # fmt: skip
        batch = _batch(ref_logprobs=None) if not with_ref else _batch()
        logp = (batch.old_logprobs + 0.1).requires_grad_()
        _, _, metrics = make_policy_loss_fn(cfg, 3)(batch, ModelOutputs(logp, entropy=torch.rand(4, 3)))
        assert all(accumulated(name) for name in metrics)  # raises on an undeclared name
        values = reduce_metrics([metrics])
        assert math.isnan(values["actor/kl"]) != with_ref  # null exactly when there is no reference
        emitted |= set(metrics)
    # both ways: no catalogued actor metric that the loss never emits (param_checksum is the loop's)
    assert emitted == _emitted_by("actor")


def test_every_critic_update_metric_is_catalogued_and_every_critic_entry_is_emitted():
    batch = _batch()
    values = batch.values + 0.3
    _, _, metrics = make_value_loss_fn(AlgorithmConfig())(batch, ModelOutputs(None, values=values))  # type: ignore[arg-type]
    assert set(metrics) == _emitted_by("critic")
    assert all(accumulated(name) for name in metrics)


def test_optimizer_metrics_are_catalogued_per_role():
    for role in ("actor", "critic"):
        names = optimizer_metric_names(role)
        assert names["grad_norm"] == f"{role}/grad_norm" and lookup(names["grad_norm"]).reduction == "mean"
        assert lookup(names["lr"]).reduction == "last"
        assert lookup(names["optimizer_steps"]).reduction == lookup(names["skipped_steps"]).reduction == "sum"


def test_advantage_step_emits_the_catalogued_advantage_metrics():
    cfg = AlgorithmConfig(estimator="grpo", overlong={"length": 1, "penalty": 1.0}, kl={"use_in_reward": True})
    _, metrics = advantage_step(_batch(), cfg, make_kl_controller(cfg.kl), max_new_tokens=3)
    assert set(metrics) == {m.name for m in CATALOGUE if m.emitter == "advantages"}


def test_controller_side_metrics_are_catalogued():
    rollout = rollout_metrics(_batch())
    assert rollout["response/truncated_frac"] == 0.25 and rollout["response_length/max"] == 3.0
    scored = ScoreResult(scores=[1.0, 0.0], extra={"acc": [1.0, math.nan]}, errors=1).metrics()
    assert lookup("reward/acc").name == "reward/<extra>"
    b = _batch(staleness=torch.tensor([0, 2, 2, 1]))
    by_staleness = mismatch_by_staleness(b.old_logprobs, b.rollout_logprobs, b.response_mask, b.staleness)
    assert sorted(by_staleness) == [f"rollout/logprob_mismatch/staleness{s}" for s in (0, 1, 2)]
    assert lookup("rollout/logprob_mismatch/staleness2").reduction == "last"
    for name in [*rollout, *scored, *by_staleness, "time/generate_s", "val/openai/gsm8k/reward/mean"]:
        assert is_catalogued(name), name


def test_every_metric_name_string_in_the_package_is_catalogued():
    # A name invented anywhere (a literal or an f-string such as f"time/{name}_s") must be declared.
    family = "|".join(sorted(families(), key=len, reverse=True))
    looks_like_metric = re.compile(rf"({family})/[a-z0-9_/]+")
    unknown: list[str] = []
    for path in sorted((ROOT / "megarl").rglob("*.py")):
        if path.name == "metrics.py" and path.parent.name == "megarl":
            continue
        tree = ast.parse(path.read_text())
        # An f-string's literal pieces (the "moe/routing_agreement/layer" of f"...layer{i}") are checked as the whole.
        pieces = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if id(node) in pieces:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            # The evaluation summary (and evaluate's table) names its values without the "val/" prefix.
            public = f"val/{text}" if path.name in ("evaluation.py", "evaluate.py") else text
            if looks_like_metric.fullmatch(text) and not is_catalogued(public):
                unknown.append(f"{path.relative_to(ROOT)}: {text}")
    assert not unknown, unknown


def test_lookup_exact_names_before_families_and_suggests_on_a_typo():
    assert lookup("time/step_s").meaning == "wall time of the RL step"  # not the time/<phase>_s family
    assert lookup("val/reward/mean").name == "val/reward/mean"
    assert lookup("val/openai/gsm8k/reward/mean").name == "val/<data_source>/reward/mean"
    with pytest.raises(UnknownMetricError, match="did you mean actor/clip_frac"):
        lookup("actor/pg_clipfrac")
    assert not is_catalogued("actor/logprob_mismatch")  # one public name: rollout/logprob_mismatch


def _metrics_page_table() -> list[tuple[list[str], list[str]]]:
    """(keys, reductions) of each row of the metrics table in docs/metrics.md."""
    rows = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 3 or cells[0] in ("key", "---"):
            continue
        rows.append((re.findall(r"`([^`]+)`", cells[0]), [r.strip() for r in cells[1].split(",")]))
    return rows


def test_metrics_page_table_lists_exactly_the_catalogue_with_its_reductions():
    rows = _metrics_page_table()
    listed = [key for keys, _ in rows for key in keys]
    assert sorted(listed) == sorted(m.name for m in CATALOGUE), "docs/metrics.md table vs megarl/metrics.py"
    for keys, reductions in rows:
        if len(reductions) == 1:
            reductions = reductions * len(keys)
        assert [lookup(k).reduction for k in keys] == reductions, keys
    assert {k.split("/")[0] for k in listed} == families()


def test_e2e_required_metrics_are_catalogued():
    tree = ast.parse((ROOT / "tests" / "e2e" / "run_helpers.py").read_text())
    required = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "REQUIRED_METRICS" for t in node.targets)
    )
    assert [name for name in required if name != "step" and not is_catalogued(name)] == []


def test_catalogue_entries_are_well_formed():
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names))
    for m in CATALOGUE:
        assert m.reduction in ("mean", "sum", "max", "min", "last", "std") and m.meaning
        assert re.fullmatch(r"[a-z_]+(/([a-z_]+|<[a-z_]+>|[a-z_@]*<[a-z_]+>[a-z_]*))+", m.name), m.name
