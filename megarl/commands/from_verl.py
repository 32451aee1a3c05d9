"""`megarl config --from-verl RUN [verl overrides] --out megarl.yaml`: a verl run as a megarl config.

The mapping is megarl/config/verl_keys.py, the reading of verl's scripts and YAML
megarl/config/verl_script.py; here the command: translate, choose the layout an FSDP run never
gave (the smallest TP x PP the planner accepts), write the config, print the table, and check the
result with the planner, so that what it writes is what `megarl plan` accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megarl.config.loading import ConfigError, validate_config
from megarl.config.sections import MegaRLConfig
from megarl.config.verl_script import read_verl
from megarl.config.verl_translate import Row, Translation, nest, table, translate
from megarl.plan.issues import PlanError


def from_verl(run_path: str, overrides: list[str], out: str | None, accept_differences: bool = False) -> int:
    """Translate, write ``out``, print the table and the plan's verdict; returns the exit code. A
    verl key whose absence would make the megarl run train differently stops it, unless accepted."""
    if not out:
        raise ConfigError("megarl config --from-verl needs --out FILE: where to write the megarl config (e.g. --out megarl.yaml)")
    translation = translate(read_verl(run_path, overrides))
    if translation.differences and not accept_differences:
        why = "; ".join(f"{r.verl}: {r.note}" for r in translation.differences)
        raise ConfigError(f"the translation of {run_path} would train differently from verl ({why}); remove the key "
                          "from the verl run, or give --accept-differences to write the config anyway")  # fmt: skip
    cfg = validate_config(translation.nested(), source=f"the translation of {run_path}", overrides=translation.origins)
    cfg, refusal = _choose_layout(cfg, translation)
    Path(out).write_text(_header(run_path, overrides) + yaml.safe_dump(_ordered(translation.nested()), sort_keys=False))
    for note in translation.notes:
        print(f"note: {note}")
    print(table(translation))
    if refusal is not None:
        raise ConfigError(f"wrote {out}, but megarl plan refuses it ({refusal}); fix the verl run or {out}, then "
                          f"`megarl plan {out}`")  # fmt: skip
    print(f"wrote {out}: megarl plan accepts it (`megarl plan {out}` prints the placement); `megarl launch {out}` trains")
    return 0


def _header(run_path: str, overrides: list[str]) -> str:
    command = " ".join(["megarl config --from-verl", run_path, *overrides])
    return f"# Translated from a verl run by `{command}`;\n# its table names the verl key behind every value.\n"


def _ordered(tree: dict[str, Any]) -> dict[str, Any]:
    """Sections in the order of `megarl config` (model, cluster, data, ...)."""
    return {name: tree[name] for name in MegaRLConfig.model_fields if name in tree}


def _choose_layout(cfg: MegaRLConfig, translation: Translation) -> tuple[MegaRLConfig, str | None]:
    """An FSDP run gives no model-parallel layout: take the smallest TP x PP (fewest GPUs per
    model copy, TP before PP) the planner accepts on the run's GPUs, shown as megarl's choice. A
    Megatron run keeps its own. Returns the config and the plan's refusal, None when it passes."""
    from megarl.plan.planner import make_plan

    if translation.megatron or "actor.parallel.tp" in translation.values:
        return cfg, _refusal(make_plan, cfg)
    roles = ["actor", "critic"] if cfg.critic_enabled else ["actor"]
    first: tuple[MegaRLConfig, str | None] | None = None
    for tp, pp in _layouts(cfg.cluster.gpus_per_node, cfg.cluster.world_size):
        values = {f"{role}.parallel.{k}": n for role in roles for k, n in (("tp", tp), ("pp", pp))}
        candidate = validate_config(nest({**translation.values, **values}))
        refusal = _refusal(make_plan, candidate)
        first = first or (candidate, refusal)
        if refusal is None:
            _record_choice(translation, values, cfg.cluster.world_size)
            return candidate, None
    assert first is not None
    return first


def _layouts(per_node: int, world: int) -> list[tuple[int, int]]:
    """(tp, pp) with TP within a node, by GPUs per model copy, TP first."""
    tps = [t for t in (1, 2, 4, 8) if t <= per_node and per_node % t == 0]
    found = [(t, p) for t in tps for p in (1, 2, 4, 8, 16) if world % (t * p) == 0]
    return sorted(found, key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[1]))


def _refusal(make_plan: Any, cfg: MegaRLConfig) -> str | None:
    try:
        make_plan(cfg)
    except PlanError as exc:
        return "; ".join(str(i) for i in exc.issues)
    return None


def _record_choice(translation: Translation, values: dict[str, Any], world: int) -> None:
    for key, value in values.items():
        translation.values[key] = value
    note = f"verl's FSDP run gives no layout: the smallest TP x PP megarl plan accepts on {world} GPUs"
    translation.choices.append(Row("(FSDP: no model-parallel layout given)", dict(values), note=note))
