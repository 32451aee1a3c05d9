"""Checks before Ray starts: everything a launch needs from the disk, read cheaply.

`make_plan(cfg, check_files=True)` (what `megarl launch` and `megarl plan --check-files` run)
calls :func:`preflight`; each problem becomes one planner Issue naming the field, the file and
the fix, so all of them are reported at once, in seconds, before Ray or any worker starts:

- data files: the parquet footer (readable, the columns, at least one row) and at most
  ``SAMPLE_ROWS`` rows checked as training checks them (megarl/data/datasets.py);
- the run's length: with trainer.total_epochs, the steps the footers' row counts make must
  exceed trainer.critic_warmup_steps (a bound when overlong prompts are dropped at load;
  megarl/trainer/build.py checks the exact count once the data is read);
- prompts: the tokenizer has a chat template when data.apply_chat_template is on; the
  tokenizer of model.path renders the sampled prompts: with ``data.truncation=error`` and
  overlong prompts not filtered, none may be over max_prompt_length; filtered, a file all
  dropped is refused and one half dropped named (a warning);
- what the model must write: a tool call in rollout.agent.tool_parser's format and each file's
  answers in its scorer's format survive model.path's tokenizer (megarl/plan/token_checks.py);
- rewards: built-in scorer names, a scorer for every sampled data_source (and a non-null
  ground truth, but for code), reward.custom importable and defining its function,
  reward.model's config.json one the reward workers load (megarl/rewards/reward_model.py: a
  sequence classifier with num_labels 1; no weights read) and its tokenizer files present;
- agent rollouts: rollout.agent.tools_file and interactions_file readable (their YAML; the
  classes are built in the child process), each sampled row's agent_name names a loop and its interaction_kwargs an
  interaction of rollout.agent.interactions_file (megarl/rollout/agents/checks.py);
- the user's own functions named by import path (algorithm.estimator, algorithm.policy_loss,
  rollout.generate_function; megarl/plan/extensions.py): importable and callable;
- model.path (and critic.path, in the critic's layout): config.json present and accepted by the
  bridges (config values, layout, the weights' tensor names and shapes), the installed
  megatron-core usable; a model checkpoint
  of `megarl convert hf-to-megatron` (as model.path or critic.path): its record readable and
  its HF config equal to the config.json beside it; critic.path's model able to read model.path's
  token ids (megarl/models/hf_files.py: token_ids_problem);
- trainer.output_dir and trainer.rollout_data_dir writable, output_dir's disk with room for a
  checkpoint (megarl/plan/disk_space.py); trainer.resume meaningful for what output_dir holds
  (megarl.checkpoint.manager.plan_resume: no destroyed evidence, no two runs in one place) and
  the checkpoint it resumes loadable in this launch (megarl/plan/resume_checks.py).

User code never runs in the driver process: the reward import and the import-path functions
run in one child process (megarl/plan/import_check_child.py), started first, in parallel with the rest. The bridge check runs in the
driver, last, whenever model.path (and critic.path) were found, whatever else failed, so that every
problem is named at once: it imports torch and transformers (a few seconds), which the driver of a launch imports anyway for the tokenizer and the controller, so
checking here costs the run nothing (it imports no Megatron module).
Nothing is created or changed on disk, but for the child's output: a temporary log file, removed
unless a check failed (the finding then names it).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config.sections import MegaRLConfig
from megarl.data.datasets import training_rows
from megarl.models.hf_files import tokenizer_files_problem
from megarl.plan.extensions import named_functions
from megarl.plan.import_check_child import ChildChecks
from megarl.plan.issues import Finding
from megarl.rewards.answers import no_answer

SAMPLE_ROWS = 1000


def preflight(cfg: MegaRLConfig, *, bridge: bool = True) -> list[Finding]:
    """Every problem found with the files and directories ``cfg`` names (empty: all good), all of
    them at once. ``bridge``: also judge model.path by its bridge in the config's layouts (the
    planner passes False when the layouts themselves are refused)."""
    from megarl.plan.resume_checks import check_resume

    findings = agent_file_findings(cfg)  # first: the prompt checks read the tools' schemas
    unreadable = {f.field for f in findings}  # named once: the child does not load them again
    child = ChildChecks(cfg.reward.custom, [(field, v) for field, v in named_functions(cfg) if field not in unreadable],
                        cfg.data.custom_cls, cfg.reward.functions, _dataset_build(cfg))
    try:
        _check_output_dir(cfg, findings)
        check_loggers(cfg, findings)
        check_resume(cfg, findings)
        samples = _check_data(cfg, findings)
        _check_run_length(cfg, findings)
        _check_prompts_per_step(cfg, findings)
        model_ok = _check_model_dir(cfg, findings)
        if model_ok:
            from megarl.data.summary import load_tokenizer

            model = cfg.model.path
            assert model is not None  # _check_model_dir found its config.json
            tokenizer = functools.cache(lambda: load_tokenizer(model))  # (seconds for a large one) loaded once
            _check_critic_tokens(cfg, tokenizer, findings)
            strict = cfg.data.truncation == "error" and not cfg.data.filter_overlong_prompts
            if cfg.data.apply_chat_template and not _has_chat_template(Path(model)):
                findings.append(Finding("data.apply_chat_template", f"is true but the tokenizer of model.path ({cfg.model.path}) "
                                        "has no chat template; set data.apply_chat_template=false to feed raw prompt text, "
                                        "or use a tokenizer with a template"))
            elif (strict or cfg.data.filter_overlong_prompts) and samples:  # lengths need the tokenizer (a second or two)
                _check_prompts(cfg, samples, tokenizer, findings)
            _check_writable(cfg, samples, tokenizer, findings)
        _check_rewards(cfg, samples, findings)
        if cfg.rollout.generate_function == "default":
            from megarl.rollout.agents.checks import row_findings

            findings += [Finding(*f) for f in row_findings(cfg.rollout.agent, [(s.label, s.path, s.records) for s in samples])]
        findings += child.results("reward")
        findings += child.results("data.custom_cls")
        for source in child.spec["reward_functions"]:
            findings += child.results(f"reward.functions[{source!r}]")
        for field, _ in child.spec["extensions"]:
            findings += child.results(field)
        # The slow one (seconds: torch and transformers), whatever the other files' problems, so
        # that a model the bridges refuse is named with them, not after they are fixed.
        models_found = not any(f.level == "error" and f.field in ("model.path", "critic.path") for f in findings)
        if bridge and model_ok and models_found:
            findings += _check_bridge(cfg)
    finally:
        child.stop()
    return findings


def agent_file_findings(cfg: MegaRLConfig) -> list[Finding]:
    """rollout.agent's tool and interaction files read as YAML (no class imported: the child
    process builds them): one that cannot be read, a relative path that does not resolve from
    the working directory, is named with the plan's other problems."""
    from megarl.rollout.agents.interactions import InteractionFileError, read_interaction_names
    from megarl.rollout.agents.tools import ToolFileError, read_tool_schemas

    agent = cfg.rollout.agent
    if cfg.rollout.generate_function != "default":
        return []
    findings = []
    for field, path, read in (("rollout.agent.tools_file", agent.tools_file, read_tool_schemas),
                              ("rollout.agent.interactions_file", agent.interactions_file, read_interaction_names)):
        try:
            if path:
                read(path)
        except (ToolFileError, InteractionFileError) as exc:
            findings.append(Finding(field, str(exc)))
    return findings


def _dataset_build(cfg: MegaRLConfig) -> dict[str, Any] | None:
    """What the check's child builds data.custom_cls with, as the run does: data.train_files, model.path's
    tokenizer (when the directory is there: else the model check names it) and the data section."""
    if cfg.data.custom_cls is None:
        return None
    model = cfg.model.path if cfg.model.path and Path(cfg.model.path, "config.json").is_file() else None
    return {"files": [str(f.path) for f in cfg.data.train_files], "field": "data.train_files", "model": model,
            "config": cfg.data.model_dump(mode="json")}


# ---- output_dir ----------------------------------------------------------------------------


def _check_output_dir(cfg: MegaRLConfig, findings: list[Finding]) -> None:
    from megarl.plan.disk_space import check_disk_space

    problem = writable_dir_problem(Path(cfg.trainer.output_dir))
    if problem:
        findings.append(Finding("trainer.output_dir", f"{problem}; choose a writable directory"))
    else:
        check_disk_space(cfg, findings)
    dump = cfg.trainer.rollout_data_dir
    problem = writable_dir_problem(Path(dump)) if dump else None
    if problem:
        findings.append(Finding("trainer.rollout_data_dir", f"{problem}; choose a writable directory, or unset it"))


LOGGER_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard", "swanlab": "swanlab"}  # logger -> what it imports


def check_loggers(cfg: MegaRLConfig, findings: list[Finding]) -> None:
    """Each logger's package is installed here (the controller, which logs), and W&B has a key where it
    cannot ask for one: not found missing after Ray started (launch, via preflight, and sft)."""
    for name in dict.fromkeys(cfg.trainer.loggers):
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            findings.append(Finding("trainer.loggers", f"includes {name}, and {package} is not installed in this Python "
                                    f"({sys.executable}); pip install {package}, or drop {name} from trainer.loggers"))  # fmt: skip
        elif name == "wandb":
            from megarl.plan.logger_checks import wandb_login_problem

            if problem := wandb_login_problem():
                findings.append(Finding("trainer.loggers", f"includes wandb: {problem}"))


def writable_dir_problem(path: Path) -> str | None:
    """Why ``path`` (an existing directory, or one that would be created) cannot be written, or
    None. A real write (a temp file, removed at once): as root, permission bits say nothing."""
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory, so {path} cannot be created"
    try:
        fd, name = tempfile.mkstemp(prefix=".megarl-write-test-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror} in {probe})"
    return None


# ---- data -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sample:
    label: str  # data.train_files[0] (x.parquet)
    records: list[Any]  # PromptRecord
    path: str = ""


def _data_files(cfg: MegaRLConfig) -> list[tuple[str, str]]:
    from megarl.data.datasets import file_label

    files = [] if cfg.trainer.val_only else [(f"data.train_files[{i}]", f.path) for i, f in enumerate(cfg.data.train_files)]
    files += [(f"data.val_files[{i}]", path) for i, path in enumerate(cfg.data.val_files)]
    return [(file_label(name, path), path) for name, path in files]


def _check_data(cfg: MegaRLConfig, findings: list[Finding]) -> list[_Sample]:
    from megarl.data.datasets import DataError, check_prompt_file

    if cfg.data.custom_cls is not None:
        return []  # the user's class reads the files, in its own format (its import and fit: the child's check)
    if not cfg.data.train_files and not cfg.trainer.val_only:
        findings.append(Finding("data.train_files", "no training files; give at least one parquet file"))
    samples = []
    for label, path in _data_files(cfg):
        try:
            samples.append(_Sample(label, check_prompt_file(path, label=label, prompt_key=cfg.data.prompt_key,
                                                            sample_rows=SAMPLE_ROWS, source_key=cfg.data.reward_fn_key),
                                   path))  # fmt: skip
        except DataError as exc:
            findings.append(_located(label, str(exc)))
    return samples


def _check_run_length(cfg: MegaRLConfig, findings: list[Finding]) -> None:
    """A run of trainer.total_epochs has as many steps as the training rows make: the critic's
    warm-up must be shorter. The parquet footers count the rows; with overlong prompts dropped
    at load that is an upper bound (launch checks the exact count once the data is read)."""
    from megarl.data.sampler import epoch_steps
    from megarl.plan.algorithm_checks import epochs_warmup_issue

    t = cfg.trainer
    if t.total_steps is not None or t.total_epochs is None or not t.critic_warmup_steps or t.val_only:
        return
    if (rows := training_rows(cfg)) is None:
        return
    issue = epochs_warmup_issue(t, rows, epoch_steps(rows, cfg.data.prompts_per_step), at_most=cfg.data.filter_overlong_prompts)
    if issue is not None:
        findings.append(Finding(issue.field, issue.message))


def _check_prompts_per_step(cfg: MegaRLConfig, findings: list[Finding]) -> None:
    """More prompts a step than training rows: the sampler wraps around within the step, so some
    prompts are drawn twice in one batch (their groups count twice in the step's mean). A
    warning: valid, and what a tiny data set wants, but rarely what a user means."""
    d = cfg.data
    if cfg.trainer.val_only or (rows := training_rows(cfg)) is None or rows >= d.prompts_per_step:
        return
    findings.append(Finding("data.prompts_per_step", f"({d.prompts_per_step}) is more than the {rows} training rows of "
                            "data.train_files: every step draws some prompts more than once; lower it to at most "
                            f"{rows} (and raise rollout.n for more samples a prompt), or give more data", level="warning"))  # fmt: skip


def _located(label: str, message: str) -> Finding:
    """A Finding for a message that starts with the file's label (as DataError's do)."""
    return Finding(label, message.removeprefix(f"{label}: "))


def _has_chat_template(model: Path) -> bool:
    """Whether the tokenizer files hold a chat template (read as JSON / file names: no transformers)."""
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return True  # unknown layout: the tokenizer itself decides at start-up


def _check_prompts(cfg: MegaRLConfig, samples: list[_Sample], tokenizer: Callable[[], Any], findings: list[Finding]) -> None:
    """The sampled prompts, rendered by the run's tokenizer, against data.max_prompt_length:
    with data.truncation=error and no filtering they must all fit (else training fails on the
    first such draw); with data.filter_overlong_prompts, a file it would empty is refused and
    one it would halve is named (_dropped). ``tokenizer``: model.path's, loaded on first call."""
    from megarl.data.datasets import DataError
    from megarl.data.prompts import PromptBuilder
    from megarl.plan.token_checks import offered_tools

    d = cfg.data
    try:
        builder = PromptBuilder.from_config(d, tokenizer(), offered_tools(cfg))
    except DataError as exc:
        findings.append(Finding("data.apply_chat_template" if "chat template" in str(exc) else "model.path", str(exc)))
        return
    for sample in samples:
        wheres = [f"{sample.label}: row {r.row}" for r in sample.records]
        try:
            lengths = builder.lengths([r.prompt for r in sample.records], wheres)
        except DataError as exc:
            findings.append(_located(sample.label, str(exc)))
            continue
        over = [i for i, n in enumerate(lengths) if n > d.max_prompt_length]
        if over and d.filter_overlong_prompts:
            findings += _dropped(sample, len(over), min(lengths), len(lengths), d.max_prompt_length)
        elif over:
            row, n = sample.records[over[0]].row, lengths[over[0]]
            findings.append(Finding(sample.label, f"row {row}: the prompt has {n} tokens > data.max_prompt_length "
                                    f"({d.max_prompt_length}), and data.truncation=error ({len(over)} of {len(lengths)} rows "
                                    "checked are over); raise data.max_prompt_length, set data.filter_overlong_prompts=true "
                                    "to drop such prompts, or set data.truncation=left|right"))


def _check_writable(cfg: MegaRLConfig, samples: list[_Sample], tokenizer: Callable[[], Any], findings: list[Finding]) -> None:
    """The tool calls and answers the run needs, writable by the model (megarl/plan/token_checks.py).
    A tokenizer that does not load stops the run at start-up: no verdict here."""
    from megarl.data.datasets import DataError
    from megarl.plan.token_checks import check_answers, check_tool_calls

    try:
        tokenizer()
    except DataError:
        return
    check_tool_calls(cfg, tokenizer, findings)
    check_answers(cfg, [(sample.label, sample.records) for sample in samples], tokenizer, findings)


def _dropped(sample: _Sample, over: int, shortest: int, checked: int, limit: int) -> list[Finding]:
    """What data.filter_overlong_prompts would do to ``sample``'s file when it drops ``over`` of
    the ``checked`` prompts: every one of a file checked whole is a refusal (the run would stop
    at start-up with no prompts to draw), half or more a warning; fewer is the run's business."""
    import pyarrow.parquet as pq

    if over == checked and checked == pq.read_metadata(sample.path).num_rows:
        return [Finding(sample.label, f"every one of its {checked} prompts is longer than data.max_prompt_length ({limit}; "
                                      f"the shortest has {shortest} tokens), and data.filter_overlong_prompts drops them: "
                                      "raise data.max_prompt_length, or cut them (data.truncation=left|right with "
                                      "data.filter_overlong_prompts=false)")]  # fmt: skip
    if 2 * over < checked:
        return []
    return [Finding(sample.label, f"{over} of the {checked} prompts checked are longer than data.max_prompt_length "
                                  f"({limit}) and data.filter_overlong_prompts drops them; raise data.max_prompt_length "
                                  "to keep them", level="warning")]  # fmt: skip


# ---- model and rewards ----------------------------------------------------------------------------------


def _check_model_dir(cfg: MegaRLConfig, findings: list[Finding]) -> bool:
    from megarl.checkpoint.model_checkpoint import (
        ModelCheckpointError,
        check_model_checkpoint,
        is_model_checkpoint,
        sft_output_hint,
    )

    path = cfg.model.path
    if path is None or not (Path(path) / "config.json").is_file():
        hint = sft_output_hint(path)
        findings.append(Finding("model.path", f"({path}) must be a local HF model directory (with config.json) or a "
                                "model checkpoint of `megarl convert hf-to-megatron` to launch" + (f"; {hint}" if hint else "")))
        return False
    problem = tokenizer_files_problem(Path(path))
    if problem:
        # transformers would build a one-token tokenizer from config.json alone and fail much later
        findings.append(Finding("model.path", f"({path}) {problem}; copy the model's tokenizer files into it"))
        return False
    ok = True
    critic = cfg.critic.path if cfg.critic_enabled else None
    if critic is not None and not (Path(critic) / "config.json").is_file():
        # else the critic ranks fail once the cluster and the policy have started (transformers
        # takes a missing directory for a hub repo id)
        findings.append(Finding("critic.path", f"({critic}) must be a local HF model directory (with config.json) or a "
                                "model checkpoint of `megarl convert hf-to-megatron`; unset, the critic starts from "
                                "model.path"))  # fmt: skip
    for field, value in (("model.path", path), ("critic.path", critic)):
        if value is not None and is_model_checkpoint(value):
            try:
                check_model_checkpoint(value)
            except ModelCheckpointError as exc:
                findings.append(Finding(field, str(exc)))
                ok = False
    return ok


def _check_critic_tokens(cfg: MegaRLConfig, tokenizer: Callable[[], Any], findings: list[Finding]) -> None:
    """critic.path's model reads the token ids of model.path's tokenizer (``tokenizer``, loaded on
    first call; a critic has none of its own at run time): one of another model family runs, on
    the wrong tokens."""
    from megarl.config.architectures import ArchError, arch_from_hf_dir
    from megarl.data.datasets import DataError
    from megarl.data.summary import load_tokenizer
    from megarl.models.hf_files import token_ids_problem

    assert cfg.model.path is not None  # called once _check_model_dir found it
    critic = Path(cfg.critic.path) if cfg.critic_enabled and cfg.critic.path is not None else None
    if critic is None or not (critic / "config.json").is_file() or critic.resolve() == Path(cfg.model.path).resolve():
        return  # no model of its own (or the policy's), or _check_model_dir's finding
    try:
        policy_tokenizer = tokenizer()
    except DataError:
        return  # a tokenizer that does not load stops the run at start-up, whatever the critic
    try:
        own = None if tokenizer_files_problem(critic) else load_tokenizer(critic)
    except DataError:  # a tokenizer the critic itself never uses: only its embedding can be told
        own = None
    try:
        rows = arch_from_hf_dir(critic).vocab_size
    except ArchError:  # a config the bridge check names
        rows = None
    problem = token_ids_problem(policy_tokenizer, rows, own, "model.path's")
    if problem:
        findings.append(Finding("critic.path", f"({critic}) {problem}; the critic reads the policy's token ids: use a "
                                "critic of the policy's model family, or unset critic.path to start it from model.path"))  # fmt: skip


def _check_bridge(cfg: MegaRLConfig) -> list[Finding]:
    """model.path's config.json accepted by its bridge (values, both parallel layouts) and, for an
    HF directory, its weights' tensor names and shapes (a model checkpoint: _check_model_dir);
    likewise critic.path's, in the critic's layout, when the critic has its own model."""
    from megarl.checkpoint.model_checkpoint import is_model_checkpoint
    from megarl.parallel.mcore_version import require_megatron_core

    assert cfg.model.path is not None  # run after no error, so after _check_model_dir found it
    own_critic = cfg.critic.path if cfg.critic_enabled else None  # else a critic starts from model.path
    shared = [cfg.critic.parallel] if cfg.critic_enabled and own_critic is None else []
    models = [("model.path", cfg.model.path, [cfg.actor.parallel, *shared])]
    if own_critic is not None:
        models.append(("critic.path", own_critic, [cfg.critic.parallel]))
    try:
        require_megatron_core()  # the installed version only: nothing of Megatron is imported
    except ImportError as exc:  # a missing or unusable megatron-core: no model can be trained
        return [Finding("model.path", f"({cfg.model.path}) is not a model megarl can train: ImportError: {exc}")]
    from megarl.models.bridges import ModelRefused, check_hf_model

    for field, path, layouts in models:
        try:
            # a model checkpoint's weights are checked by _check_model_dir; a critic's lm_head is unused
            check_hf_model(path, tuple(layouts), value_head=field == "critic.path", weights=not is_model_checkpoint(path))
        except ModelRefused as exc:
            return [Finding(field, f"({path}) is not a model megarl can train: {exc}")]
    return []


def _check_rewards(cfg: MegaRLConfig, samples: list[_Sample], findings: list[Finding]) -> None:
    import megarl.rewards.registry as registry
    from megarl.plan.reward_checks import combine_findings

    r = cfg.reward
    if r.custom is not None and r.model is not None:
        findings.append(Finding("reward", "reward.custom and reward.model are both set; set one of them "
                                "(a custom function can call a model itself)"))
    if r.model is not None:
        from megarl.rewards.reward_model import model_dir_problem

        problem = model_dir_problem(r.model.path)
        if problem:
            findings.append(Finding("reward.model.path", problem))
    if r.custom is not None and not Path(r.custom.path).is_file():
        findings.append(Finding("reward.custom.path", f"{r.custom.path} does not exist; give the path of a Python file"))
    try:
        registry.check_functions(r.functions)
    except ValueError as exc:
        findings.append(Finding("reward.functions", str(exc)))
        return
    files = [(sample.label, sample.records) for sample in samples]
    findings += scorer_findings(r, files)
    findings += combine_findings(cfg, files)


def scorer_findings(reward: Any, files: list[tuple[str, list[Any]]]) -> list[Finding]:
    """What the built-in scorers of ``reward`` (a RewardConfig) cannot score in ``files`` (label,
    PromptRecords): a data_source none takes (named once), and per file the first row whose
    ground truth none can compare with (null, blank, NaN: every response would score 0, silently).
    A reward.custom or reward.model takes anything."""
    import megarl.rewards.registry as registry

    if reward.custom is not None or reward.model is not None:
        return []
    findings: list[Finding] = []
    scorers: dict[str, str | None] = {}
    for label, records in files:
        no_truth = None
        for record in records:
            if record.data_source in reward.combine:  # its named components score it (megarl/plan/reward_checks.py)
                continue
            if record.data_source not in scorers:
                try:
                    scorers[record.data_source] = registry.resolve(record.data_source, reward.functions)
                except ValueError as exc:
                    scorers[record.data_source] = None
                    findings.append(Finding(label, f"row {record.row}: {exc}"))
            name = scorers[record.data_source]
            if no_truth is None and name not in (None, "code") and (problem := _truth_problem(name, record.ground_truth)):
                no_truth = Finding(label, f"row {record.row}: reward_model.ground_truth {problem}")
        if no_truth is not None:
            findings.append(no_truth)
    return findings


def _truth_problem(name: str, ground_truth: Any) -> str | None:
    """Why the built-in scorer ``name`` would score every response 0 against ``ground_truth``
    (the rest of the sentence after "reward_model.ground_truth"), or None."""
    import megarl.rewards.registry as registry
    from megarl.data.datasets import short_repr

    if no_answer(ground_truth):
        return (f"is {ground_truth!r}; the built-in scorer {name!r} compares each response with it: give the answer, "
                "or score with reward.custom")  # fmt: skip
    if not registry.can_match(name, ground_truth):
        return (f"{short_repr(ground_truth)} is no number; the built-in scorer {name!r} compares numbers, so every "
                "response would score 0: write the number alone (commas and $ allowed), map the data_source to another "
                "scorer in reward.functions, or score with reward.custom")  # fmt: skip
    return None
