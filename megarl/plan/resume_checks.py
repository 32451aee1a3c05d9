"""Checks before Ray starts of what a launch resumes (megarl/plan/preflight.py runs them):
the checkpoint trainer.resume names must be readable by this megatron-core, trained from the
same model (and a critic it holds from a model of the same architecture), and loadable in this
launch's layout (the optimizer state's format, a critic it holds), LoRA settings (actor.lora on
or off, its rank, modules and alpha; a LoRA base's replaced weight files) and data settings (the sampler's rule); other config changes are named in one warning,
going back to an older checkpoint says what is set aside, and a finished run says so
(finished_run, before Ray starts; finished_note, also the trainer's when it finds out later).
Nothing is created or changed on disk.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megarl.checkpoint.run_record import LORA_BASE_FILE
from megarl.config.differences import differences as dict_differences
from megarl.config.sections import ROLE_SECTIONS, MegaRLConfig
from megarl.data.datasets import training_rows
from megarl.models.weight_files import weights_fingerprint
from megarl.plan.issues import Finding


def finished_run(cfg: MegaRLConfig) -> str | None:
    """A message when output_dir's newest checkpoint already is at the run's last step:
    trainer.total_steps, or the steps trainer.total_epochs makes of the training files' rows. The
    footers count the rows before overlong prompts are dropped at load, so that count is an upper
    bound: a run that dropped prompts is found finished only once its data is read (Trainer.fit)."""
    from megarl.checkpoint.manager import plan_resume
    from megarl.checkpoint.verification import CheckpointError
    from megarl.data.sampler import epoch_steps

    t = cfg.trainer
    total, epochs = t.total_steps, None
    if total is None and t.total_epochs is not None and (rows := training_rows(cfg)) is not None:
        total, epochs = t.total_epochs * epoch_steps(rows, cfg.data.prompts_per_step), t.total_epochs
    if t.val_only or total is None or t.resume == "disable":
        return None
    try:
        ckpt = plan_resume(t.output_dir, t.resume, quiet=True)
    except CheckpointError:
        return None
    if ckpt is None or ckpt.step < total:
        return None
    return finished_note(t.output_dir, ckpt.path.name, ckpt.step, total, epochs=epochs)


def finished_note(output_dir: str | Path, checkpoint: str, step: int, total_steps: int, *, epochs: int | None = None) -> str:
    """Why a run whose checkpoint is at, or past (a resume with a smaller total_steps),
    its last step has nothing to train, and the ways on. ``epochs``: the run's length is
    trainer.total_epochs (``total_steps`` is what those passes make), not trainer.total_steps."""
    length = f"trainer.total_steps ({total_steps})" if epochs is None else f"the {total_steps} steps of trainer.total_epochs ({epochs})"
    if step == total_steps:
        where, longer = f"is at {length}", "raise trainer.total_steps" if epochs is None else "raise trainer.total_epochs"
    else:
        where = f"is step {step}, past {length}"
        longer = f"raise trainer.total_steps above {step}" + ("" if epochs is None else " (it overrides trainer.total_epochs)")
    return (f"{output_dir} already finished: its checkpoint {checkpoint} {where}; nothing to train. To train longer "
            f"{longer}; to start over give a new trainer.output_dir (or move {output_dir} away)")


def check_resume(cfg: MegaRLConfig, findings: list[Finding]) -> None:
    from megarl.checkpoint.manager import plan_resume
    from megarl.checkpoint.verification import CheckpointError

    try:
        ckpt = plan_resume(cfg.trainer.output_dir, cfg.trainer.resume, quiet=True)
    except CheckpointError as exc:  # the message starts with "trainer.resume=<value>": the field
        findings.append(Finding(f"trainer.resume={cfg.trainer.resume}", re.sub(r"^trainer\.resume=('[^']*'|\S+?):?\s", "", str(exc))))
        return
    if ckpt is not None and "policy" in ckpt.components:
        from megarl.parallel.mcore_version import check_checkpoint_readable

        try:
            check_checkpoint_readable(ckpt.component("policy"))
        except (ValueError, ImportError) as exc:
            findings.append(Finding("trainer.resume", str(exc)))
    if ckpt is not None:
        _check_resumed_config(cfg, ckpt, findings)
        _check_metrics_file(cfg, ckpt, findings)
        _check_going_back(cfg, ckpt, findings)


def _check_metrics_file(cfg: MegaRLConfig, ckpt: Any, findings: list[Finding]) -> None:
    """A metrics.jsonl the resume cannot mend (a line that is no JSON record, and no copy in the
    checkpoint to take its place) is refused now, not once the model is up; what it can mend
    (a missing file, a bad line, records changed since the save) it does with a warning then
    (megarl/trainer/metric_sinks.py)."""
    from megarl.checkpoint.metrics_history import METRICS_FILE, unrepairable
    from megarl.checkpoint.run_record import METRICS_HISTORY

    t = cfg.trainer
    if "jsonl" not in t.loggers or t.val_only:  # a validation-only run appends: it reads nothing
        return
    problem = unrepairable(Path(t.output_dir) / METRICS_FILE, ckpt.path / METRICS_HISTORY)
    if problem:
        findings.append(Finding("trainer.output_dir", problem))


def _check_going_back(cfg: MegaRLConfig, ckpt: Any, findings: list[Finding]) -> None:
    """Said before launch: a resume from an older checkpoint of this run sets the newer ones aside
    (with their size: each branch set aside stays on the disk until a person removes it)."""
    from megarl.checkpoint.manager import (
        ABANDONED,
        manifest_bytes,
        newer_step_dirs,
        starts_new_history,
    )

    t = cfg.trainer
    newer = newer_step_dirs(t.output_dir, ckpt) if starts_new_history(t.resume, t.val_only) else []
    if newer:
        names = ", ".join(p.name for p in newer[:4]) + (", ..." if len(newer) > 4 else "")
        gib = sum(manifest_bytes(p) or 0 for p in newer) / 2**30
        findings.append(Finding("trainer.resume", f"goes back to step {ckpt.step}: the run's newer checkpoints ({names}; "
                                f"{gib:.2g} GiB) will be kept as <name>.{ABANDONED} (not resumed from, not pruned: remove "
                                f"them when no longer needed) and the metrics and validation samples after step {ckpt.step} kept aside; for the "
                                "latest, use trainer.resume=auto", level="warning"))  # fmt: skip


# What may change between a run's launches without a word: how long it runs, where it resumes from.
RESUME_FREE_KEYS = ("trainer.total_steps", "trainer.total_epochs", "trainer.resume")


def _check_resumed_config(cfg: MegaRLConfig, ckpt: Any, findings: list[Finding]) -> None:
    """The launch's config against the one the checkpoint was trained with: another model is
    refused (the policy would go on from the checkpoint's weights while the reference loads the
    new model), and so are data settings the sampler cannot resume (megarl/data/sampler.py) and a
    layout the optimizer state cannot load in (RESUME_LAYOUT_KEYS); any other change is named
    (the run goes on with the new values)."""
    from megarl.checkpoint.run_record import (
        MODEL_CONFIG,
        RUN_CONFIG,
        launch_dirs,
        model_config_differences,
    )
    from megarl.config.loading import ConfigError, load_config
    from megarl.data.sampler import resume_conflicts, resume_settings

    try:
        old = load_config(ckpt.path / RUN_CONFIG)
    except ConfigError:  # none, or written by a megarl whose config differs: nothing to compare
        findings += _lora_changes(cfg, None, ckpt)  # (what the checkpoint's own files tell)
        return
    # where the run was launched, as `megarl convert` finds it: its relative paths start there
    launched = next(iter(launch_dirs(ckpt, old.trainer.output_dir)), Path.cwd())
    problem = _another_model(old, cfg, launched)
    if problem:
        findings.append(Finding("model.path", f"({cfg.model.path or cfg.model.arch}) {problem}, not the model "
                                f"{ckpt.path.name} was trained from: its policy would go on from the checkpoint while the "
                                "reference loads the new one; resume with the run's model, or start from the new one in "
                                "a new trainer.output_dir"))  # fmt: skip
    elif (replaced := _replaced_base(cfg, ckpt)) is not None:
        findings.append(Finding("model.path", replaced))
    elif cfg.model.path is not None:
        differ = model_config_differences(ckpt, cfg.model.path)
        if differ:  # rope_theta / rope_scaling change no shape: the run would go on under another model config
            findings.append(Finding("model.path", f"({cfg.model.path}) config.json differs from the one {ckpt.path.name} "
                                    f"was trained with ({'; '.join(differ)}); restore it (a copy is "
                                    f"{ckpt.path / MODEL_CONFIG}), or start a new run from the new model in a new "
                                    "trainer.output_dir"))  # fmt: skip
    if "critic" in ckpt.components and cfg.critic_enabled:
        findings += _another_critic(old, cfg, ckpt, launched)
    # the data sampler's stream is a function of these: it would refuse them once Ray has started
    refused = [Finding(field, f"cannot resume {ckpt.path.name}: {why}")  # (val_only loads it too)
               for field, why in resume_conflicts(resume_settings(old.data), resume_settings(cfg.data))]
    differences = dict_differences(old.model_dump(), cfg.model_dump())
    refused += _layout_changes(differences, ckpt, old, cfg.critic_enabled)
    refused += _lora_changes(cfg, old, ckpt)
    findings += refused
    changed = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in differences.items()
               if k not in (*RESUME_FREE_KEYS, "model.path", "model.arch", *(f.field for f in refused)) and b != "auto"]  # fmt: skip
    # (the saved config holds what a plan resolved: "auto" there is the same choice)
    if changed:
        shown = "; ".join(changed[:6]) + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
        findings.append(Finding("trainer.resume", f"{ckpt.path.name} was trained with another config, and the run goes "
                                f"on with this one: {shown}", level="warning"))  # fmt: skip


# What a trained role's optimizer state in a checkpoint is laid out by, so a resume keeps these:
# Megatron reshards the distributed optimizer's dp_reshardable state over DP only, its
# fully_reshardable state and the non-distributed optimizer's (per parameter, keyed like the
# weights) over TP and PP too (<section>.optimizer.checkpoint_format at save; CHECKPOINT_METADATA
# in megarl/megatron_runtime/training.py). Expert parallelism splits an MoE model's optimizer in
# two (dense and expert parameters, each over its own data-parallel group) at ep > 1 but not at
# ep 1: ep may change only where the save keyed the state per parameter alone, not under the chain
# member's prefix (fully_reshardable state written by a megarl that records it:
# UNPREFIXED_OPTIMIZER_RECORD); etp is kept in every format (not tried yet).
RESUME_LAYOUT_KEYS = {
    "policy": ("actor.parallel.tp", "actor.parallel.pp", "actor.parallel.ep", "actor.parallel.etp",
               "actor.optimizer.distributed", "model.dtype"),
    "critic": ("critic.parallel.tp", "critic.parallel.pp", "critic.parallel.ep", "critic.parallel.etp",
               "critic.optimizer.distributed", "model.dtype"),
}  # fmt: skip
FULLY_RESHARDABLE_KEYS = (".parallel.tp", ".parallel.pp")  # (suffixes) what fully_reshardable state may change
UNPREFIXED_KEYS = (".parallel.ep",)  # (suffixes) what unprefixed fully_reshardable state may change too


def _layout_changes(differences: dict[str, tuple[Any, Any]], ckpt: Any, old: MegaRLConfig, critic: bool) -> list[Finding]:
    """A refusal per changed key of RESUME_LAYOUT_KEYS for the roles ``ckpt`` holds (TP and PP
    only where a role's optimizer state is the distributed optimizer's dp_reshardable), and for a
    critic it does not hold
    (``critic``: the launch trains one). Either would fail once every worker has started:
    inside Megatron's load with a KeyError, or for want of the critic. ``old``: the config
    ``ckpt`` was trained with."""
    from megarl.parallel.mcore_version import (
        checkpoint_optimizer_format,
        checkpoint_optimizer_unprefixed,
    )

    new_run = "start a new run from its weights (`megarl convert` it, then model.path) in a new trainer.output_dir"
    keys: dict[str, str] = {}  # each key the roles' state keeps, with (one of) its role(s)
    trained = {"policy", *(["critic"] if critic else [])}  # a critic this launch does not train is not loaded
    for role in (r for r in ckpt.components if r in RESUME_LAYOUT_KEYS and r in trained):
        distributed = getattr(old, ROLE_SECTIONS[role]).optimizer.distributed
        reshardable = not distributed or checkpoint_optimizer_format(ckpt.path / role) == "fully_reshardable"
        unprefixed = distributed and checkpoint_optimizer_unprefixed(ckpt.path / role)
        for key in RESUME_LAYOUT_KEYS[role]:
            free = (reshardable and key.endswith(FULLY_RESHARDABLE_KEYS)) or (unprefixed and key.endswith(UNPREFIXED_KEYS))
            if not free:
                keys.setdefault(key, role)
    found = []
    for key, role in keys.items():
        if key not in differences:
            continue
        a, b = differences[key]
        later = ""  # how the run's later checkpoints could change it (the distributed optimizer's only)
        section = ROLE_SECTIONS[role]
        if key.endswith(FULLY_RESHARDABLE_KEYS + UNPREFIXED_KEYS) and getattr(old, section).optimizer.distributed:
            later = (f"; to change it at a later resume, resume once with {key}={a} and "
                     f"{section}.optimizer.checkpoint_format=fully_reshardable: the checkpoints it saves may change it")
        elif key.endswith(UNPREFIXED_KEYS):  # the non-distributed optimizer: its own key is kept at a resume too
            later = (f"; the non-distributed optimizer's checkpoints never change it, and {section}.optimizer.distributed "
                     f"is kept at a resume too: start that new run with {section}.optimizer.distributed=true and "
                     f"{section}.optimizer.checkpoint_format=fully_reshardable, whose checkpoints may change it")
        found.append(Finding(key, f"{ckpt.path.name} was trained with {key}={a}, and its optimizer state loads only with the "
                                  f"same value (the data-parallel size may change), not {b}; resume with {key}={a}, or "
                                  f"{new_run}{later}"))  # fmt: skip
    if critic and "critic" not in ckpt.components:
        for key in [k for k in ("algorithm.estimator", "critic.enabled") if k in differences]:
            was = differences[key][0]
            found.append(Finding(key, f"this launch trains a critic and {ckpt.path.name} holds none (trained with {key}={was}): "
                                      f"a resume cannot add one; resume with {key}={was}, or {new_run}"))  # fmt: skip
    return found




def lora_base_record(ckpt: Any) -> dict[str, Any] | None:
    """What ``ckpt``'s policy records of the base model its adapters were trained on
    (``policy/lora_base.json``: path, fingerprint, and since it was written by a megarl that
    records them, ``files``: :func:`weights_fingerprint` of the base); None for a whole-model
    checkpoint (or one without a policy)."""
    import json

    if "policy" not in ckpt.components:
        return None
    record = ckpt.path / "policy" / LORA_BASE_FILE
    try:
        return dict(json.loads(record.read_text())) if record.is_file() else None
    except (OSError, ValueError):  # unreadable: the policy ranks' check_lora_base reports it
        return {}


def _lora_changes(cfg: MegaRLConfig, old: MegaRLConfig | None, ckpt: Any) -> list[Finding]:
    """A refusal for a resume the policy's LoRA state cannot load in, found before Ray starts
    (the policy ranks' check_lora_base stays the backstop, after the model's load): a LoRA
    checkpoint without actor.lora or a whole-model one with it, and a change of the adapters'
    shapes (actor.lora.rank, actor.lora.target_modules: Megatron's load would fail with a shape
    or key mismatch) or of their scale (actor.lora.alpha: the same adapters at another alpha /
    rank change the policy's output at the resume, as a changed rope_theta in model.path's
    config.json would, which is refused too). ``old``: the config ``ckpt`` was trained with
    (None: unreadable, so only the checkpoint's own files tell)."""
    record = lora_base_record(ckpt)
    if "policy" not in ckpt.components or (record is None and old is None):
        return []
    name, new_run = ckpt.path.name, "or start a new run in a new trainer.output_dir"
    lora, was = cfg.actor.lora, old.actor.lora if old is not None else None
    if record is not None and lora is None:
        trained = "" if was is None else f": actor.lora={{rank: {was.rank}, alpha: {was.alpha:g}, target_modules: {was.target_modules}}}"
        return [Finding("actor.lora", f"(unset) {name} holds LoRA adapters (policy/{LORA_BASE_FILE}{trained}), not the "
                                      f"whole model's weights, and this launch trains the whole model; resume with "
                                      f"actor.lora as that run set it, {new_run}")]  # fmt: skip
    if record is None and lora is not None:
        return [Finding("actor.lora", f"{name} holds the whole model's weights (no policy/{LORA_BASE_FILE}), not LoRA "
                                      "adapters, and this launch sets actor.lora; resume without actor.lora (actor.lora="
                                      f"null), {new_run} (to adapt the trained model: `megarl convert` {name}, then "
                                      "model.path)")]  # fmt: skip
    if lora is None or was is None:
        return []
    found = []
    if was.rank != lora.rank:
        found.append(Finding("actor.lora.rank", f"{name}'s adapters were trained with actor.lora.rank={was.rank} "
                             f"(A [rank, in], B [out, rank]) and load only at that rank, not {lora.rank}; resume with "
                             f"actor.lora.rank={was.rank}, {new_run}"))  # fmt: skip
    if was.modules != lora.modules:
        found.append(Finding("actor.lora.target_modules", f"{name} holds adapters of {', '.join(was.modules)} (actor."
                             f"lora.target_modules={was.target_modules}), and this launch's are {', '.join(lora.modules)}: "
                             f"a resume loads exactly the adapters it holds; resume with actor.lora.target_modules="
                             f"{was.target_modules}, {new_run}"))  # fmt: skip
    if was.alpha != lora.alpha and was.rank == lora.rank:
        found.append(Finding("actor.lora.alpha", f"{name}'s adapters were trained at actor.lora.alpha={was.alpha:g} "
                             f"(scale alpha / rank = {was.scale:g}); at {lora.alpha:g} the same adapters would add "
                             f"{lora.alpha / was.alpha:.3g}x their update to every adapted layer and the policy's output "
                             f"would jump at the resume; resume with actor.lora.alpha={was.alpha:g}, {new_run}"))  # fmt: skip
    return found


def _replaced_base(cfg: MegaRLConfig, ckpt: Any) -> str | None:
    """Why model.path no longer holds the base a LoRA checkpoint's adapters were trained on, when
    the path is the same but its weights were replaced (None when they are the same, or when it
    cannot be told: a whole-model checkpoint, one saved before lora_base.json recorded the base's
    files, a model.path that does not exist). Compares :func:`weights_fingerprint`: each weight
    file's name, size and a hash of its first and last MiB (a few MiB per file, a second at 72B),
    which the save recorded (the policy ranks compare the weights' sums after the load, too)."""
    record = lora_base_record(ckpt)
    files = (record or {}).get("files")
    if files is None or cfg.model.path is None or not Path(cfg.model.path).is_dir():
        return None
    now = [list(f) for f in weights_fingerprint(Path(cfg.model.path))]
    if now == [list(f) for f in files]:
        return None
    recorded, current = {f[0]: f[1:] for f in files}, {f[0]: f[1:] for f in now}
    changed = sorted(n for n in {*recorded, *current} if recorded.get(n) != current.get(n))
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (f"({cfg.model.path}) holds other weights than the base {ckpt.path.name}'s adapters were trained on "
            f"({record.get('path') if record else cfg.model.path}; weight files that differ: {shown}): the adapters "
            "would go on from another base; restore that base at model.path, or start a new run in a new "
            "trainer.output_dir")  # fmt: skip


def _another_critic(old: MegaRLConfig, new: MegaRLConfig, ckpt: Any, launched: Path) -> list[Finding]:
    """A refusal when the critic's model (critic.path, else model.path) has another config.json
    than the one ``ckpt``'s critic was trained as (as the policy's model is refused): another
    architecture's weights would only fail to load once every worker has started (a shape
    mismatch inside Megatron's load). Another directory of the
    same architecture is fine (the weights come from the checkpoint); when neither launch set
    critic.path the model.path check covers it. The trained-as config is the copy the checkpoint
    keeps (megarl/checkpoint/run_record.py); one saved by an older megarl has none: the old
    directory's config.json as it is now."""
    import json

    from megarl.checkpoint.model_checkpoint import config_differences
    from megarl.checkpoint.run_record import CRITIC_MODEL_CONFIG, MODEL_CONFIG

    if old.critic.path is None and new.critic.path is None:
        return []
    was, now = old.critic.path or old.model.path, new.critic.path or new.model.path
    if was is None or now is None:
        return []
    copy = ckpt.path / (CRITIC_MODEL_CONFIG if old.critic.path else MODEL_CONFIG)
    try:
        recorded = json.loads((copy if copy.is_file() else (launched / was) / "config.json").read_text())
        current = json.loads((Path(now) / "config.json").read_text())
    except (OSError, ValueError):  # moved since, or unreadable: nothing to compare (now's own check reports it)
        return []
    differ = config_differences(recorded, current)
    if not differ:
        return []
    shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
    this = f"critic.path={new.critic.path}" if new.critic.path else f"model.path={now} (critic.path unset)"
    before = f"critic.path={old.critic.path}" if old.critic.path else f"model.path={was}"
    return [Finding("critic.path", f"this launch's critic model ({this}) differs from the one the critic of "
                    f"{ckpt.path.name} was trained as ({before}: {shown}), whose weights the checkpoint holds; resume with "
                    f"critic.path={was}, or start a new run in a new trainer.output_dir")]  # fmt: skip


def _another_model(old: MegaRLConfig, new: MegaRLConfig, launched: Path) -> str | None:
    """Why ``new``'s model is not ``old``'s (None when it is, or when that cannot be told): the
    same directory, or one whose weight files are the same (a moved or staged copy) is the same
    model; a path that no longer exists cannot be compared."""
    was, now = old.model.path, new.model.path
    if was is None or now is None:  # planned from a built-in architecture: the name decides
        if (was, (old.model.arch or "").lower()) != (now, (new.model.arch or "").lower()):
            return f"is not model.{'path' if was else 'arch'}={was or old.model.arch}"
        return None
    before, after = (launched / was).resolve(), Path(now).resolve()
    if before == after or not before.is_dir() or not after.is_dir():  # (a missing model.path has its own refusal)
        return None
    if weights_fingerprint(before) != weights_fingerprint(after):
        return f"holds other weights than model.path={was}"
    return None

