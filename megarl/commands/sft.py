"""`megarl sft CONFIG [KEY=VALUE ...]`: supervised fine-tuning before RL, with the RL run's
model, policy worker, parallel layout (actor.parallel, actor.micro_batch_size) and optimizer
and LR schedule (actor.optimizer).

The data, steps and output are the config's ``sft`` section (megarl/data/sft.py: prompt +
response columns or chat conversations; only response / assistant tokens are trained). Every
``sft.eval_freq`` steps and after the last, the loss on ``sft.val_files`` is logged
(``sft/val_loss``); metrics go where the RL run's go (console, ``<sft.output_dir>/metrics.jsonl``,
TensorBoard, W&B as trainer.loggers says).

The result is ``<sft.output_dir>/model``: a model checkpoint (the format of `megarl convert
hf-to-megatron`, recording the HF config), written beside itself, loaded back and compared bit
for bit, then renamed into place. With LoRA (``actor.lora``) only the adapters train; ``model`` is
the merged model (base + alpha/rank * B A, a plain model without adapters) and
``<sft.output_dir>/lora_adapter`` the adapters as an HF PEFT adapter of model.path (none when
model.path is a model checkpoint, which PEFT cannot name as a base). ``model.path=<sft.output_dir>/model`` starts RL from it (the
reference too) with any layout, and `megarl convert megatron-to-hf` exports it. An existing
``model`` directory is never replaced: the run is refused before it starts.

A first Ctrl-C or SIGTERM (Slurm preemption) stops after the current step and still writes
(and verifies) the model; a second one stops at once. SFT does not resume.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from megarl.checkpoint.model_checkpoint import SFT_MODEL_DIR as MODEL_DIR
from megarl.commands.arguments import add_config_args
from megarl.commands.supervision import Supervision, starts_ray, supervised_command
from megarl.trainer.watchdog import RunControl

log = logging.getLogger(__name__)


class SFTError(ValueError):
    """An SFT setting that cannot work (no data, a batch the layout cannot split, an existing output)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sft",
        help="supervised fine-tuning (response / assistant tokens only) into a checkpoint RL starts from",
        description="Trains the config's model on sft.train_files with the RL run's policy worker, layout and "
        "optimizer; the loss covers response tokens (prompt + response rows) or assistant turns (chat "
        "conversations) only. Writes <sft.output_dir>/model, a model checkpoint verified bit for bit: "
        "`megarl launch CONFIG model.path=<sft.output_dir>/model` starts RL from it and `megarl convert` exports it. "
        "With actor.lora (e.g. actor.lora.rank=8) only the adapters train: model is the merged model, and "
        "<sft.output_dir>/lora_adapter the adapters as an HF PEFT adapter directory of model.path.",
    )
    add_config_args(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", default=None, help="Ray cluster to attach to: auto or host:port (default: embedded local Ray)")
    where.add_argument("--in-process", action="store_true",
                       help="no Ray: the policy worker in this process (a world of one, e.g. one GPU; needs "
                       "cluster.nnodes=1 cluster.gpus_per_node=1)")  # fmt: skip
    p.set_defaults(handler=supervised_command(_run, _prepare))


def _prepare(args: argparse.Namespace) -> Supervision:
    """A config mistake: its line from the command's process, no driver started; what a driver
    that dies without a word leaves (for the supervisor's line)."""
    from megarl.config.loading import load_config
    from megarl.trainer.run_lock import output_dir_lock

    output_dir = load_config(args.config, args.overrides).sft.output_dir
    target = Path(output_dir) / MODEL_DIR
    kept = (f"SFT keeps no checkpoint to resume from, and {target} appears only once written whole and verified (it is "
            "staged beside itself): run the same command again")
    return Supervision(kept, ray=starts_ray(args), user_code=None,  # SFT trains on sft.train_files: none of the user's code
                       holds=partial(output_dir_lock, Path(output_dir).absolute(), "sft.output_dir"))  # refused before the imports


def _run(args: argparse.Namespace) -> int:
    from megarl.config.loading import load_config

    cfg = load_config(args.config, args.overrides)
    run_sft(cfg, args.address, in_process=args.in_process)
    print(f"wrote {Path(cfg.sft.output_dir) / MODEL_DIR}: start RL from it with model.path={Path(cfg.sft.output_dir) / MODEL_DIR}")
    from megarl.models.lora import PEFT_ADAPTER_DIR

    adapter = Path(cfg.sft.output_dir) / PEFT_ADAPTER_DIR
    if cfg.actor.lora is not None and adapter.is_dir():
        print(f"wrote {adapter}: the LoRA adapters as an HF PEFT adapter of {cfg.model.path}")
    return 0


def run_sft(cfg: Any, address: str | None = None, *, in_process: bool = False) -> Path:
    """Fine-tune, then write and verify ``<sft.output_dir>/model``; returns its path.
    ``in_process``: the worker lives in this process, without Ray (a world of one)."""
    from megarl.progress import still_waiting
    from megarl.trainer.run_lock import output_dir_lock
    from megarl.trainer.watchdog import run_stoppable

    # a Ctrl-C, SIGTERM or SIGHUP during the checks or the tokenizing: one line, nothing left running
    with still_waiting("checking the config"):
        cfg, plan, hf_config = run_stoppable(lambda: _checked_with_model(cfg, address, in_process),
                                             "while checking the config; nothing was started")
    # Held from before the data is read (seconds of tokenizing): a second sft into this folder is
    # refused at once, as a second launch is, not once it has read everything.
    with output_dir_lock(Path(cfg.sft.output_dir).absolute(), "sft.output_dir"):
        with still_waiting("reading the data"):
            data = run_stoppable(lambda: _checked_data(cfg, plan), "while reading the data; nothing was started")
        return _fine_tune(cfg, plan, hf_config, data, address, in_process)


def _fine_tune(cfg: Any, plan: Any, hf_config: dict[str, Any], data: _Data, address: str | None, in_process: bool) -> Path:
    """The run once checked, its output folder held and its data read: Ray, the workers, the
    steps, then the model written and verified."""
    from megarl.trainer.launch import DRIVER_LOG, driver_log

    s, dp = cfg.sft, plan.roles["policy"].dp
    out = Path(s.output_dir).absolute()
    target = out / MODEL_DIR
    steps = s.total_steps or -(-s.epochs * len(data.train) // s.batch_size)  # ceil: every row seen in each pass
    # Imports happen here, before the signal handlers: a SIGTERM during the seconds Ray's take
    # must find the run starting (nothing written), not half-way through an import.
    placement, ray = (None, None) if in_process else _ray_start(cfg, plan, address)
    control = RunControl(saves="the model")  # a stop writes and verifies the model; SFT keeps no checkpoint
    stopped = lambda: control.stopped(f"stopped by {control.signal_name} while starting; nothing was trained or written")  # noqa: E731
    with driver_log(out / "logs" / DRIVER_LOG), control.handlers(), ExitStack() as session:
        # Logged once a signal is handled: a SIGTERM sent on seeing it stops the run cleanly.
        log.info("sft: %d training rows, %d held-out, %d steps of %d sequences (DP=%d)", len(data.train), len(data.val),
                 steps, s.batch_size, dp)  # fmt: skip
        if ray is not None:  # (None in process)
            control.enter_starting(session, ray, stopped)
        try:  # the workers load the model: a signal now leaves nothing to keep either
            client, group = _start_group(cfg, placement, steps, out / "logs")
        except KeyboardInterrupt:
            raise stopped() from None
        try:
            done = _train(cfg, client, data, steps, dp, control)
            control.cleaning = True  # the weights are written whatever comes now
            _write_model(cfg, client, target, hf_config)
        finally:
            group.shutdown()
    if done < steps:
        raise control.stopped(f"stopped by {control.signal_name} after step {done} of {steps}; the weights so far are in "
                              f"{target} (verified); SFT does not resume: start RL from them, or fine-tune them further "
                              f"with model.path={target} and another sft.output_dir")  # fmt: skip
    return target


def _checked_with_model(cfg: Any, address: str | None, in_process: bool) -> tuple[Any, Any, dict[str, Any]]:
    """The checks (:func:`_checked`), then the model's config.json, read now (the model record
    written after training needs it, and a config.json gone by then must not cost the trained
    weights)."""
    from megarl.commands.model_outputs import read_hf_config

    cfg, plan = _checked(cfg, address, in_process)
    return cfg, plan, read_hf_config(Path(cfg.model.path).absolute(), "model.path")


def _checked_data(cfg: Any, plan: Any) -> _Data:
    """The tokenized rows, checked against the batch."""
    from megarl.plan.planner import sft_max_length

    data = _load_data(cfg, sft_max_length(cfg, plan.arch))
    _check_batch_fits(len(data.train), cfg.sft.batch_size, plan.roles["policy"].dp)
    return data


def _checked(cfg: Any, address: str | None, in_process: bool) -> tuple[Any, Any]:
    """``cfg`` resolved by its plan, and the plan, once what needs no data is checked: the
    batch against the data-parallel size, the machine, the output folder, the loggers. Every
    problem found is reported at once: one alone as it reads (an SFTError, or the plan's
    PlanError), several in one SFTError, a line each."""
    from megarl.plan.issues import PlanError
    from megarl.plan.planner import resolved_config
    from megarl.plan.preflight import check_loggers
    from megarl.trainer.launch import launch_plan

    s = cfg.sft
    problems: list[str] = []
    if not s.train_files:
        problems.append("sft.train_files is empty; give parquet files with prompt + response columns or chat messages")
    plan, refused = None, None
    try:
        plan = launch_plan(cfg, address, sft=True, in_process=in_process)  # the machine's problems with the config's
    except PlanError as exc:
        refused = exc
    if plan is not None:
        cfg = resolved_config(cfg, plan.resolved)  # recompute: auto is none here (no memory plan)
        dp = plan.roles["policy"].dp
        if s.batch_size % dp:
            problems.append(f"sft.batch_size ({s.batch_size}) must be a multiple of the data-parallel size ({dp}); "
                            f"try {max(dp, s.batch_size // dp * dp)}")  # fmt: skip
    try:
        _check_target(Path(s.output_dir).absolute() / MODEL_DIR, cfg)
    except SFTError as exc:
        problems.append(str(exc))
    findings: list[Any] = []
    check_loggers(cfg, findings)
    problems += [f"{f.field}: {f.message}" for f in findings]
    if refused is not None and not problems:
        raise refused
    if refused is not None or len(problems) > 1:
        every = [str(i) for i in refused.issues] if refused is not None else []
        raise SFTError(f"megarl sft cannot start ({len(every) + len(problems)} problems):\n"
                       + "\n".join(f"  - {p}" for p in every + problems) + (refused.warned() if refused is not None else ""))
    if problems:
        raise SFTError(problems[0])
    assert plan is not None
    if cfg.data.custom_cls is not None:  # an RL config's dataset class: said, or SFT would seem to train on it
        log.warning("sft: data.custom_cls %s is not used: megarl sft trains on sft.train_files (parquet files with prompt + "
                    "response columns or chat messages); write your class's rows to such a file", cfg.data.custom_cls.name)
    return cfg, plan


def _check_target(target: Path, cfg: Any) -> None:
    from megarl.checkpoint.manager import scan_step_dirs
    from megarl.checkpoint.model_checkpoint import RECORD
    from megarl.commands.model_outputs import check_output_target
    from megarl.commands.outputs import OutputError, same_file
    from megarl.models.lora import PEFT_ADAPTER_DIR

    if target.parent.exists() and not target.parent.is_dir():  # else "move the old model away"
        raise SFTError(f"sft.output_dir ({cfg.sft.output_dir}) is a file; give a folder (megarl sft writes "
                       f"{MODEL_DIR}/ and logs/ in it)")  # fmt: skip
    rl = scan_step_dirs(target.parent)
    if rl:  # its metrics.jsonl would be moved aside and an RL resume there would meet an SFT model
        raise SFTError(f"sft.output_dir ({cfg.sft.output_dir}) holds an RL run ({rl[-1][1].name} in its checkpoints/); "
                       "give megarl sft a folder of its own")  # fmt: skip
    if cfg.model.path and same_file(target, Path(cfg.model.path)):  # "move it away" would move the model SFT starts from
        raise SFTError(f"{target} is model.path, the model SFT starts from, and <sft.output_dir>/model is where SFT "
                       f"writes its own; give another sft.output_dir than {cfg.sft.output_dir}")  # fmt: skip
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise SFTError(f"{target} exists (an earlier megarl sft wrote it?) and is never replaced; give another "
                       "sft.output_dir, or move it away")  # fmt: skip
    adapter = target.with_name(PEFT_ADAPTER_DIR)
    if cfg.actor.lora is not None and (adapter.exists() or adapter.with_name(f".{PEFT_ADAPTER_DIR}.writing").exists()):
        raise SFTError(f"{adapter} (or .{PEFT_ADAPTER_DIR}.writing) exists (an earlier megarl sft with actor.lora wrote it?) "
                       "and is never replaced; give another sft.output_dir, or move it away")  # fmt: skip
    try:
        check_output_target(target, False, {"the model directory of model.path": Path(cfg.model.path or "")}, manifest=RECORD)
    except OutputError as exc:
        raise SFTError(f"{exc} (sft.output_dir={cfg.sft.output_dir}: give another one, or move the old model away)") from None


class _Data:
    """The tokenized rows, with what batching needs."""

    def __init__(self, train: list[Any], val: list[Any], pad_id: int) -> None:
        self.train, self.val, self.pad_id = train, val, pad_id


def _load_data(cfg: Any, max_length: int) -> _Data:
    """The SFT rows, tokenized; rows over ``max_length`` tokens (sft.max_length, or the model's
    positions when fewer) are dropped."""
    from transformers import AutoTokenizer

    from megarl.data.prompts import PromptBuilder
    from megarl.data.sft import read_sft_file
    from megarl.engines.base import eos_token_ids

    s, path = cfg.sft, str(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = eos_token_ids(path, tokenizer)
    builder = PromptBuilder(tokenizer, max_prompt_length=max_length, apply_chat_template=cfg.data.apply_chat_template,
                            chat_template_kwargs=cfg.data.apply_chat_template_kwargs)

    def read(files: list[str], field: str) -> list[Any]:
        return [e for i, f in enumerate(files) for e in read_sft_file(
            f, label=f"sft.{field}[{i}]", builder=builder, eos_id=eos[0], prompt_key=s.prompt_key,
            response_key=s.response_key, messages_key=s.messages_key, max_length=max_length)]  # fmt: skip

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return _Data(read(s.train_files, "train_files"), read(s.val_files, "val_files"), pad)


def _ray_start(cfg: Any, plan: Any, address: str | None) -> tuple[Any, Any]:
    """Where the policy's ranks go, and Ray's session (embedded with as many CPUs as ranks plus
    the driver, or the cluster at ``address``), not entered yet: nothing starts here."""
    from megarl.ray_cluster.placement import role_placements
    from megarl.ray_cluster.session import ray_session

    local_cpus = None if (address or cfg.cluster.ray_address) else len(plan.roles["policy"].gpus) + 1
    return role_placements(cfg, plan)[0][0], ray_session(address or cfg.cluster.ray_address, num_cpus=local_cpus)


def _start_group(cfg: Any, placement: Any, steps: int, log_dir: Path) -> tuple[Any, Any]:
    """The SFT ranks: a Ray worker group on ``placement``, or (None) one rank in this process."""
    from megarl.actors.clients import Group, InProcessGroup, SFTClient
    from megarl.actors.sft_rank import SFTRank
    from megarl.progress import still_waiting

    if placement is None:
        with still_waiting("sft: building SFTRank in this process (loads the model)"):
            group: Group = InProcessGroup(SFTRank, cfg, steps)
    else:
        from megarl.ray_cluster.worker_group import GroupOptions, WorkerGroup

        options = GroupOptions.of_run(cfg.cluster, log_dir)
        group = WorkerGroup(SFTRank, placement, cfg, steps, group_options=options)
    return SFTClient(group), group


def _check_batch_fits(rows: int, batch_size: int, dp: int) -> None:
    """A step cannot hold more rows than there are: it would repeat rows, and an sft.epochs "pass"
    would be many passes. (The last step of a pass is filled from the next pass's order.)"""
    if rows >= batch_size:
        return
    fits = rows // dp * dp
    fix = (f"set sft.batch_size to at most {fits} (a multiple of the data-parallel size {dp}), or give more rows" if fits
           else f"give at least {dp} training rows (the data-parallel size)")  # fmt: skip
    raise SFTError(f"sft.batch_size ({batch_size}) is more than the {rows} training row(s): a step would hold rows "
                   f"twice; {fix}")  # fmt: skip


def _batches(data: _Data, batch_size: int, seed: int) -> Iterator[list[Any]]:
    """Training rows in a new seeded order each epoch, ``batch_size`` at a time, epochs running on."""
    from megarl.data.sft import epoch_order

    epoch, order = 0, epoch_order(len(data.train), 0, seed)
    while True:
        if len(order) < batch_size:
            epoch += 1
            order = order + epoch_order(len(data.train), epoch, seed)
            continue
        yield [data.train[i] for i in order[:batch_size]]
        order = order[batch_size:]


def _train(cfg: Any, client: Any, data: _Data, steps: int, dp: int, control: RunControl) -> int:
    """The optimizer steps; a first Ctrl-C / SIGTERM ends them after the current one (the model
    is written then). Returns the steps done."""
    from megarl.data.sft import sft_batch
    from megarl.trainer.metric_sinks import build_logger

    s = cfg.sft
    logger = build_logger(cfg.trainer.model_copy(update={"output_dir": s.output_dir}), cfg.model_dump(mode="json"), steps)
    control.deferred = True
    try:
        batches = _batches(data, s.batch_size, cfg.trainer.seed)
        for step in range(1, steps + 1):
            metrics = client.train_step(sft_batch(next(batches), data.pad_id))
            last = step == steps or control.stop_requested
            if data.val and ((s.eval_freq and step % s.eval_freq == 0) or last):
                metrics["sft/val_loss"] = validation_loss(client, data, s.batch_size, dp)
            logger.log(step, metrics)
            if last:
                return step
    finally:
        logger.close()
    return steps


def validation_loss(client: Any, data: _Data, batch_size: int, dp: int) -> float:
    """Mean NLL of the held-out rows' trained tokens (a short last chunk is padded to the DP
    size with masked copies)."""
    from megarl.data.sft import sft_batch

    total, count = 0.0, 0.0
    for start in range(0, len(data.val), batch_size):
        chunk = data.val[start : start + batch_size]
        batch = sft_batch([*chunk, *[chunk[0]] * (-len(chunk) % dp)], data.pad_id)
        mask = batch.response_mask.clone()  # [B, R]
        mask[len(chunk) :] = 0
        logprobs = client.compute_logprobs(batch)  # [B, R]
        total += float(-(logprobs * mask).sum())
        count += float(mask.sum())
    return total / count


def _write_model(cfg: Any, client: Any, target: Path, hf_config: dict[str, Any]) -> None:
    """The fine-tuned weights as a model checkpoint at ``target``: staged, verified, renamed."""
    from megarl.checkpoint.model_checkpoint import SFT_SOURCE, write_verified
    from megarl.commands.model_outputs import finish_output, staged_output
    from megarl.memory.handover import Handover
    from megarl.memory.residency import EXPORT, sft_residency
    from megarl.progress import still_waiting

    source = Path(cfg.model.path).absolute()
    p = cfg.actor.parallel
    record = dict(source=f"{SFT_SOURCE}{source}", tp=p.tp, pp=p.pp, dtype=cfg.model.dtype, hf_config=hf_config)
    # Room for the second model the verify load builds: the memory hand-over's export phase.
    Handover(sft_residency(), {"policy": client}).enter(EXPORT)
    with staged_output(target) as staging:
        try:
            with still_waiting(f"sft: writing the model to {target} and loading it back to verify it", done_line=False):
                checked = write_verified(staging, source, record, client.save_model, client.verify_model)
        except Exception as exc:  # the trained weights die with the group: keep what was written
            kept = target.with_name(f"{target.name}.unverified")
            kept = kept if not kept.exists() else kept.with_name(f"{kept.name}.{os.getpid()}")
            staging.rename(kept)
            raise SFTError(f"writing or verifying {target} failed ({type(exc).__name__}: {exc}); what was written is "
                           f"kept in {kept} (unverified)") from exc  # fmt: skip
        finish_output(staging, target)
    log.info("sft: verified: %d parameters loaded back from %s equal the trained ones bit for bit", checked, target)
    if cfg.actor.lora is not None:
        _write_adapter(client, target.parent, source, cfg.actor.lora)


def _write_adapter(client: Any, out: Path, base: Path, lora: Any) -> None:
    """LoRA: the trained adapters as an HF PEFT adapter directory ``<sft.output_dir>/lora_adapter``
    of the HF model ``base`` (model.path), written beside itself and renamed into place; none
    when ``base`` is a model checkpoint, which PEFT cannot name as a base (the merged model is
    the output then)."""
    from megarl.checkpoint.model_checkpoint import is_model_checkpoint
    from megarl.models.lora import PEFT_ADAPTER_DIR, adapts_experts

    if is_model_checkpoint(base):
        log.warning("sft: no PEFT adapter written: model.path %s is a megarl model checkpoint, which a PEFT adapter "
                    "cannot name as its base; the merged model is %s", base, out / MODEL_DIR)  # fmt: skip
        return
    if adapts_experts(base, lora):
        log.warning("sft: no PEFT adapter written: the run adapted mixture-of-experts experts, which PEFT cannot name "
                    "in transformers' fused experts; the merged model is %s", out / MODEL_DIR)  # fmt: skip
        return
    staging = out / f".{PEFT_ADAPTER_DIR}.writing"
    client.save_adapter(str(staging), str(base))
    staging.rename(out / PEFT_ADAPTER_DIR)
    log.info("sft: wrote %s: the adapters as an HF PEFT adapter of %s", out / PEFT_ADAPTER_DIR, base)
