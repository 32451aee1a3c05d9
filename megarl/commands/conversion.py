"""The conversions behind `megarl convert` (both directions), which `megarl generate` also runs
to export a checkpoint it generates from: where the ranks run (a run's layout under Ray, CPU
processes for a model checkpoint, or one rank in this process), the staged and verified output,
its manifest. What the command line accepts: megarl/commands/convert.py."""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.commands.model_outputs import (
    EXPORT_MANIFEST,
    check_output_target,
    finish_output,
    read_hf_config,
    staged_output,
)
from megarl.commands.outputs import OutputError
from megarl.progress import NOTE_EVERY_S, still_waiting

log = logging.getLogger(__name__)

# A model conversion initialises nothing at random that it keeps (every weight is loaded), so any
# seed does; the export's bucket size bounds rank 0's extra memory while writing.
CONVERSION_SEED, EXPORT_BUCKET_MB = 1, 512.0
DTYPES = ("float32", "bfloat16", "float16")  # what an export may write


def convert_checkpoint(checkpoint: str | Path, out: str | Path, config: str | Path | None = None, overwrite: bool = False,
                       report: Any = None, verify: bool = True, in_process: bool = False,
                       adapter: bool | None = False) -> Path:  # fmt: skip
    """Write the policy of ``checkpoint`` (a step_NNNNNN directory) as an HF directory ``out``
    (``in_process``: with one rank in this process, no Ray; a run's layout of one rank only).
    A LoRA checkpoint's is the merged model; ``adapter``: also its adapters as an HF PEFT adapter
    directory ``out/lora_adapter`` (None: when it is a LoRA checkpoint; True: refused otherwise)."""
    from megarl.checkpoint.run_record import model_config_change, other_dtype_note
    from megarl.checkpoint.verification import verify_checkpoint
    from megarl.plan.planner import make_plan

    ckpt = verify_checkpoint(checkpoint)  # a torn checkpoint is refused here, naming what is wrong
    cfg = _run_config(ckpt, config)
    adapter_base = _lora_base(ckpt.path, cfg, adapter)
    changed = model_config_change(ckpt, cfg.model.path) if cfg.model.path else None
    if changed:  # its config.json is what the export writes beside the weights
        raise OutputError(changed)
    note = other_dtype_note(ckpt, cfg.model.dtype) if config is not None else None
    if note and report is not None:
        report(note)
    target = Path(out).absolute()
    check_output_target(target, overwrite, {"the run's checkpoints directory": ckpt.path.parent,
                                            "the model directory of model.path": Path(cfg.model.path)})
    ranks = _run_ranks(cfg, make_plan(cfg), ckpt.path.name, in_process)
    rank_args = (cfg.model.path, cfg.actor, cfg.model.dtype, cfg.trainer.seed, cfg.rollout.weight_sync.bucket_mb, str(ckpt.path))
    with _where_it_runs(ranks, ckpt.path.name):
        checked = _write_hf_output(target, ranks, rank_args, verify, (str(ckpt.path.resolve()), ckpt.step), report,
                                   adapter_base)  # fmt: skip
    if report is not None:
        from megarl.models.lora import adapts_experts

        merged = " (the base model with the LoRA adapters merged)" if cfg.actor.lora is not None else ""
        report(f"wrote {out}{merged} from {ckpt.path} (step {ckpt.step}, {_parallel_text(cfg.actor.parallel)}); "
               f"{_verified(checked)}")  # fmt: skip
        if adapter_base is not None:
            from megarl.models.lora import PEFT_ADAPTER_DIR

            report(f"wrote {Path(out) / PEFT_ADAPTER_DIR}: the adapters as an HF PEFT adapter of {adapter_base}")
        elif adapter is None and merged and adapts_experts(Path(cfg.model.path or "").absolute(), cfg.actor.lora):
            report("no HF PEFT adapter: the run adapted mixture-of-experts experts, which PEFT cannot name in "
                   "transformers' fused experts; the merged model above is the export")  # fmt: skip
    return Path(out)


def _run_config(ckpt: Any, config: str | Path | None) -> Any:
    """The checkpoint's run config (megarl/checkpoint/run_record.py); a LoRA checkpoint whose base
    model is not where the config says is refused by the base's recorded path: its adapters alone
    are in the checkpoint, the export loads the rest from there."""
    import json

    from megarl.checkpoint.run_record import LORA_BASE_FILE, run_config
    from megarl.config.loading import ConfigError

    try:
        return run_config(ckpt, config)
    except ConfigError:
        record = ckpt.path / "policy" / LORA_BASE_FILE
        if not record.is_file():
            raise
        base = json.loads(record.read_text())["path"]
        raise OutputError(f"{ckpt.path} holds LoRA adapters only, and their base model {base} (policy/{LORA_BASE_FILE}) "
                          "is not there: put the base model back there, or pass --config with a model.path naming where it "
                          "is now") from None  # fmt: skip


def _lora_base(ckpt: Path, cfg: Any, adapter: bool | None) -> str | None:
    """A LoRA checkpoint's base model when its PEFT adapter is written (``adapter``, see
    :func:`convert_checkpoint`): the run's model.path (absolute; :func:`_run_config` found it), which
    must be an HF directory. Checked before anything starts (OutputError naming the fix)."""
    from megarl.checkpoint.model_checkpoint import is_model_checkpoint
    from megarl.checkpoint.run_record import LORA_BASE_FILE
    from megarl.models.lora import adapts_experts

    record = ckpt / "policy" / LORA_BASE_FILE
    if not record.is_file() and cfg.actor.lora is not None:
        raise OutputError(f"{ckpt} holds a whole model, not LoRA adapters (no policy/{LORA_BASE_FILE}), and the config "
                          "sets actor.lora: drop actor.lora from --config")  # fmt: skip
    if not record.is_file():
        if adapter:
            raise OutputError(f"{ckpt} holds a whole model, not LoRA adapters (no policy/{LORA_BASE_FILE}): convert it "
                              "without --adapter")  # fmt: skip
        return None
    if cfg.actor.lora is None:
        raise OutputError(f"{ckpt} holds LoRA adapters (policy/{LORA_BASE_FILE}) and the config has no actor.lora: "
                          "pass --config with the run's actor.lora, or leave --config out")  # fmt: skip
    base = Path(cfg.model.path or "").absolute()
    if adapter is False:
        return None
    if adapts_experts(base, cfg.actor.lora):
        if adapter:
            raise OutputError(f"{ckpt} has LoRA adapters on mixture-of-experts experts, which an HF PEFT adapter cannot "
                              "hold (transformers fuses a layer's experts): pass --no-adapter for the merged model")  # fmt: skip
        return None  # the merged model is the export (convert_checkpoint says so)
    if is_model_checkpoint(base):
        raise OutputError(f"{ckpt}'s base model {base} is a megarl model checkpoint, which a PEFT adapter cannot name "
                          f"as its base: pass --no-adapter for the merged model alone, or convert the base to HF "
                          f"(megarl convert {base} BASE_HF) and train the adapters on that")  # fmt: skip
    return str(base)


def check_in_process(checkpoint: str | Path) -> None:
    """Refuse ``--in-process`` (OutputError) for a training checkpoint whose run's layout has
    more than one rank, before anything is written (`megarl generate` checks it before its
    partial folder; a model checkpoint exports with one rank whatever its layout)."""
    from megarl.checkpoint.run_record import run_config
    from megarl.checkpoint.verification import verify_checkpoint
    from megarl.plan.planner import make_plan

    ckpt = verify_checkpoint(checkpoint)
    cfg = run_config(ckpt)
    _run_ranks(cfg, make_plan(cfg), ckpt.path.name, in_process=True)


def export_model_checkpoint(checkpoint: str | Path, out: str | Path, tp: int | None = None, pp: int | None = None,
                            overwrite: bool = False, verify: bool = True, report: Any = None,
                            in_process: bool = False, ep: int | None = None, etp: int | None = None) -> Path:  # fmt: skip
    """Write a model checkpoint of hf-to-megatron as an HF directory ``out`` (with its recorded
    layout, or ``tp`` x ``pp`` (x ``ep`` x ``etp``: experts) CPU processes; ``in_process``: one rank in this
    process, no Ray, TP=PP=EP=1 unless given: a model checkpoint loads into any layout, whatever it
    was saved in)."""
    from megarl.checkpoint.model_checkpoint import check_model_checkpoint

    source = Path(checkpoint).absolute()
    record = check_model_checkpoint(source)
    target = Path(out).absolute()
    check_output_target(target, overwrite, {"the model checkpoint": source})
    tp = (1 if in_process else int(record["tp"])) if tp is None else tp
    pp = (1 if in_process else int(record["pp"])) if pp is None else pp
    ep = (1 if in_process else int(record.get("ep", 1))) if ep is None else ep  # records before MoE have none
    etp = (1 if in_process else int(record.get("etp", 1))) if etp is None else etp
    actor = _layout_config(source, tp, pp, ep, etp)
    rank_args = (str(source), actor, record["dtype"], CONVERSION_SEED, EXPORT_BUCKET_MB, None)
    checked = _write_hf_output(target, _cpu_ranks(tp, pp, in_process, ep, etp), rank_args, verify, (str(source), None), report)
    if report is not None:
        report(f"wrote {out} from {source} ({_layout_text(tp, pp, ep, etp)}); {_verified(checked)}")
    return Path(out)


def convert_hf_to_megatron(hf: str | Path, out: str | Path, tp: int = 1, pp: int = 1, dtype: str | None = None,
                           overwrite: bool = False, report: Any = None, in_process: bool = False,
                           ep: int = 1, etp: int = 1) -> Path:  # fmt: skip
    """Write the HF model ``hf`` as a model checkpoint ``out`` (Megatron dist-checkpoint saved by
    ``tp`` x ``pp`` CPU processes, times the data-parallel replicas ``ep`` x ``etp`` need (an MoE
    model's experts split over ``ep`` ranks, each expert over ``etp``), or ``in_process`` by one rank in this process; with the HF
    config and tokenizer); verified bit for bit."""
    from megarl.actors.conversion_rank import ImportRank
    from megarl.checkpoint.model_checkpoint import write_verified
    from megarl.models.carried_tensors import save_carried

    source, target, hf_config = check_hf_import(hf, out, overwrite)
    dtype = dtype or _config_dtype(hf_config)
    actor = _layout_config(source, tp, pp, ep, etp, check_weights=True)
    ranks = _cpu_ranks(tp, pp, in_process, ep, etp)
    say = report or (lambda _: None)
    with staged_output(target, report) as staging:
        say(f"hf-to-megatron: loading {source} into {ranks.count} rank(s) ({_layout_text(tp, pp, ep, etp)}, {dtype}) ...")
        with _conversion_group(ImportRank, ranks, (str(source), actor, dtype, CONVERSION_SEED),
                               "hf-to-megatron: rank 0 loading") as client:  # fmt: skip
            say("hf-to-megatron: saving the Megatron checkpoint, then loading it back to compare ...")
            record = dict(source=str(source), tp=tp, pp=pp, ep=ep, etp=etp, dtype=dtype, hf_config=hf_config)
            checked = write_verified(staging, source, record, client.write, client.verify)
        save_carried(source, staging)  # e.g. DeepSeek-V3's MTP layers: no Megatron parameter holds them
        finish_output(staging, target)
    say(f"wrote {out} from {source} ({_layout_text(tp, pp, ep, etp)}, {dtype}); {_verified(checked)}")
    return Path(out)


def check_hf_import(hf: str | Path, out: str | Path, overwrite: bool) -> tuple[Path, Path, dict[str, Any]]:
    """hf-to-megatron's input and output, checked before any work (OutputError naming the fix):
    the HF directory (absolute), OUT (absolute) and the HF config."""
    from megarl.checkpoint.model_checkpoint import RECORD, is_model_checkpoint

    source = Path(hf).absolute()
    if is_model_checkpoint(source):
        raise OutputError(f"--hf {hf} is already a model checkpoint; give an HF model directory (config.json + safetensors)")
    target = Path(out).absolute()
    check_output_target(target, overwrite, {"the HF model directory": source}, manifest=RECORD)
    return source, target, read_hf_config(source)


def _layout_text(tp: int, pp: int, ep: int, etp: int = 1) -> str:
    return f"TP={tp}, PP={pp}" + (f", EP={ep}" if ep > 1 else "") + (f", ETP={etp}" if etp > 1 else "")


def _parallel_text(parallel: Any) -> str:
    """A training checkpoint's layout as the summary names it: the policy's TP, PP, EP and ETP."""
    return _layout_text(parallel.tp, parallel.pp, parallel.ep, parallel.etp)


# ---- the conversion groups --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversionRanks:
    """Where a conversion group's ``count`` ranks run: a Ray group in ``placement`` (a
    RolePlacement; on the Ray cluster at ``address``, else an embedded Ray of count + 1 CPUs), or,
    ``in_process``, its one rank in this process (no Ray)."""

    count: int
    placement: Any = None
    address: str | None = None
    in_process: bool = False


def _cpu_ranks(tp: int, pp: int, in_process: bool, ep: int = 1, etp: int = 1) -> ConversionRanks:
    """A model conversion's ranks: ``tp`` x ``pp`` x the fewest data-parallel replicas over which
    Megatron can lay ``ep`` x ``etp`` expert ranks (ep x etp must divide tp x dp); CPU processes on
    this machine, or this process."""
    count = tp * pp * (ep * etp // math.gcd(ep * etp, tp))
    if in_process:
        given = (f" --ep {ep}" if ep > 1 else "") + (f" --etp {etp}" if etp > 1 else "")
        one = (" --ep 1" if ep > 1 else "") + (" --etp 1" if etp > 1 else "")
        return _one_rank(count, f"--tp {tp} --pp {pp}{given}", f"use --tp 1 --pp 1{one}, or run without --in-process")
    from megarl.ray_cluster.placement import RolePlacement

    return ConversionRanks(count, RolePlacement("convert", 1, count, gpus_per_proc=0.0, cpus_per_proc=1.0))


def _run_ranks(cfg: Any, plan: Any, name: str, in_process: bool) -> ConversionRanks:
    """A training checkpoint's ranks: its run's policy placement (``name``: the checkpoint's)."""
    count = len(plan.roles["policy"].gpus)
    if in_process:
        return _one_rank(count, f"{name}'s layout (the run's policy)", "run it without --in-process (Ray starts them)")
    from megarl.ray_cluster.placement import role_placements

    placements, _ = role_placements(cfg, plan)
    return ConversionRanks(count, placements[0], cfg.cluster.ray_address)


def _one_rank(count: int, layout: str, fix: str) -> ConversionRanks:
    if count != 1:
        raise OutputError(f"--in-process converts with one rank, in this process; {layout} has {count} ranks: {fix}")
    return ConversionRanks(1, in_process=True)


@contextmanager
def _where_it_runs(ranks: ConversionRanks, name: str) -> Iterator[None]:
    """A training checkpoint whose layout the Ray cluster cannot hold (a GPU run's checkpoint on
    a machine without GPUs): the error says where it can be exported."""
    if ranks.in_process:
        yield
        return
    from megarl.ray_cluster.placement import MissingCapacity

    try:
        yield
    except MissingCapacity as exc:
        p = ranks.placement
        alone = "; a layout of one rank: --in-process exports it in this process" if ranks.count == 1 else ""
        raise OutputError(f"{exc}; {name} is exported in the run's policy layout ({ranks.count} ranks, "
                          f"{f'{p.gpus_per_proc:g} GPU each' if p.gpus_per_proc else 'on CPUs'}): run megarl convert where the run "
                          f"ran, or pass --config with the cluster.ray_address of a Ray cluster that has them{alone}") from None  # fmt: skip


@contextmanager
def _conversion_group(rank_cls: type, ranks: ConversionRanks, rank_args: tuple, progress: str) -> Iterator[Any]:
    """A ConversionClient over a group of ``rank_cls``, with a progress bar (``progress``: its
    label) of rank 0's tensors; a Ray group's logs are named when the group starts, and kept (and
    named by the error) only when something failed in a rank that wrote one (not when the cluster
    could not place the ranks; a rank in this process writes to this process's output)."""
    from megarl.actors.clients import ConversionClient
    from megarl.driver_supervisor import report

    logs = Path(tempfile.mkdtemp(prefix="megarl-convert-logs-"))
    report(rank_logs=str(logs))  # a driver Ray ends at the C level cleans up nothing: its supervisor keeps or removes them
    if not ranks.in_process:  # named at once: a kill -9 of the command itself leaves it, and nothing can say so then
        log.info("the ranks' logs: %s (removed at the end unless a rank fails)", logs)
    progress_file = logs / "progress"  # rank 0 on another node writes its own: no bar then
    failed = False
    try:
        with _progress_bar(progress_file, progress), _rank_group(rank_cls, ranks, rank_args, logs) as group:
            yield ConversionClient(group)
    except (KeyboardInterrupt, SystemExit):  # stopped by the user: nothing to diagnose
        raise
    except BaseException as exc:
        failed = _keeps_rank_logs(logs, exc)
        raise
    finally:
        if not failed:
            shutil.rmtree(logs, ignore_errors=True)


def _keeps_rank_logs(logs: Path, exc: BaseException) -> bool:
    """Whether a failed conversion keeps its folder of rank logs: when the error names it (a rank
    killed right after its start: "(log: <folder>/policy_rank0.log)", a file the user must find),
    or a rank's log says more than its start line; else it goes (it says nothing)."""
    from megarl.rank_logs import says_something

    named = str(logs) in "\n".join(str(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None)
    return named or any(p.suffix == ".log" and says_something(p) for p in logs.iterdir())


@contextmanager
def _rank_group(rank_cls: type, ranks: ConversionRanks, rank_args: tuple, logs: Path) -> Iterator[Any]:
    """The group of ``rank_cls`` where ``ranks`` says, shut down on exit."""
    progress_file = str(logs / "progress")
    if ranks.in_process:
        from megarl.actors.clients import InProcessGroup
        from megarl.terminal import library_warnings_logged

        with library_warnings_logged():  # Megatron's "Apex is not installed" and the like: not on the terminal
            group: Any = InProcessGroup(rank_cls, *rank_args, progress_file=progress_file)
            try:
                yield group
            finally:
                group.shutdown()
        return
    from megarl.driver_supervisor import RAY_REPORTS_LOG
    from megarl.ray_cluster.session import ray_session
    from megarl.ray_cluster.worker_group import GroupOptions, WorkerGroup

    with ray_session(ranks.address, num_cpus=None if ranks.address else ranks.count + 1, ray_reports=logs / RAY_REPORTS_LOG):
        group = WorkerGroup(rank_cls, ranks.placement, *rank_args, group_options=GroupOptions(log_dir=logs),
                            progress_file=progress_file)  # fmt: skip
        try:
            yield group
        finally:
            group.shutdown()


@contextmanager
def _progress_bar(path: Path, label: str, poll_s: float = 0.5) -> Iterator[None]:
    """A rich progress bar (as the trainer's console) following the ``done total`` that rank 0
    writes to ``path``; it appears once the first count arrives. On a pipe, a line every
    NOTE_EVERY_S with the count instead (a big model's minutes are no silent log)."""
    import sys
    import threading

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not sys.stdout.isatty():
        with still_waiting(lambda: _tensor_count(path, label), first_s=NOTE_EVERY_S, done_line=False):
            yield
        return

    stop = threading.Event()
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"), TimeElapsedColumn(),
                   disable=not sys.stdout.isatty(), transient=False)  # fmt: skip
    task = None

    def follow() -> None:
        nonlocal task
        while not stop.wait(poll_s):
            try:
                done, total = map(int, path.read_text().split())
            except (OSError, ValueError):
                continue  # not written yet
            if task is None:
                task = bar.add_task(label, total=total)
            bar.update(task, completed=done, total=total)

    thread = threading.Thread(target=follow, name="megarl-convert-progress", daemon=True)
    bar.start()
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.stop()


def _tensor_count(path: Path, label: str) -> str:
    """``<label>: done/total tensors`` from rank 0's count ("" before it wrote one)."""
    try:
        done, total = map(int, path.read_text().split())
    except (OSError, ValueError):
        return ""
    return f"{label}: {done}/{total} tensors"


def _write_hf_output(target: Path, ranks: ConversionRanks, rank_args: tuple, verify: bool, source: tuple[str, int | None],
                     report: Callable[[str], None] | None, adapter_base: str | None = None) -> int | None:  # fmt: skip
    """Staged, verified and swapped in at ``target``: the HF files of the ExportRank group's model
    with their manifest (``source``: the checkpoint and its step), config.json naming the dtype
    the tensors were written in (``rank_args[2]``; the copied one names the model directory's),
    and with ``adapter_base`` a LoRA checkpoint's PEFT adapter of that base in ``lora_adapter/``.
    The parameters verified (None when not verified)."""
    from megarl.models.hf_files import set_config_dtype

    with staged_output(target, report) as staging:
        checked = _export_hf(ranks, rank_args, staging, verify, report, adapter_base)
        written = staging / "v0"
        set_config_dtype(written, rank_args[2])
        _write_manifest(written, *source, checked)
        finish_output(written, target)
    return checked


def _export_hf(ranks: ConversionRanks, rank_args: tuple, staging: Path, verify: bool,
               report: Callable[[str], None] | None, adapter_base: str | None = None) -> int | None:  # fmt: skip
    """HF files of the ExportRank group's model in ``staging``/v0 (with the index, and the PEFT
    adapter of ``adapter_base`` when given); the parameters verified (None when not verified)."""
    from megarl.actors.conversion_rank import ExportRank, write_index
    from megarl.models.carried_tensors import write_carried

    say = report or (lambda _: None)
    where = " in this process" if ranks.in_process else ""
    say(f"megatron-to-hf: loading {rank_args[-1] or rank_args[0]} into {ranks.count} rank(s){where} ...")
    with _conversion_group(ExportRank, ranks, rank_args, "megatron-to-hf: exporting") as client:
        say("megatron-to-hf: writing HF safetensors ...")
        client.write(str(staging))
        written = staging / "v0"
        write_carried(Path(rank_args[0]), written)  # the tensors hf-to-megatron carried (MTP layers), bit for bit
        write_index(written)
        if adapter_base is not None:  # (the files are read back and compared as they are written)
            from megarl.models.lora import PEFT_ADAPTER_DIR

            say(f"megatron-to-hf: writing the PEFT adapter in {PEFT_ADAPTER_DIR}/ ...")
            client.write_adapter(str(written / PEFT_ADAPTER_DIR), adapter_base)
        if not verify:
            return None
        say("megatron-to-hf: importing the written files back to compare ...")
        return client.verify(str(written))


def _layout_config(model_dir: Path, tp: int, pp: int, ep: int = 1, etp: int = 1, check_weights: bool = False) -> Any:
    """The ActorConfig of a conversion layout, refused (OutputError naming --tp/--pp/--ep/--etp) when the
    model cannot be split that way; ``check_weights``: also the HF safetensors' names and shapes
    (headers only), so a bad --hf is refused before Ray starts."""
    from megarl.config.train_sections import ActorConfig, ParallelConfig

    for name, value in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--etp", etp)):
        if value < 1:
            raise OutputError(f"{name} ({value}) must be >= 1")
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp)
    try:
        from transformers import AutoConfig

        from megarl.parallel.mcore_version import require_megatron_core

        require_megatron_core()
        from megarl.models.bridges import get_bridge

        hf_config = AutoConfig.from_pretrained(str(model_dir))
        bridge = get_bridge(hf_config)
        bridge.check_hf_config(hf_config)
        bridge.check_parallel(hf_config, parallel)
        if check_weights:
            bridge.check_hf_checkpoint(hf_config, str(model_dir))
    except FileNotFoundError as exc:
        raise OutputError(f"--hf {model_dir}: {exc}") from None
    except ValueError as exc:
        message = str(exc)
        for knob in ("etp", "tp", "pp", "ep"):  # etp first: "parallel.tp" is no part of "parallel.etp"
            message = message.replace(f"parallel.{knob}", f"--{knob}")
        raise OutputError(f"{model_dir}: {message}") from None
    return ActorConfig(parallel=parallel)


def _config_dtype(hf_config: dict[str, Any]) -> str:
    """The HF config's dtype when it is one megarl trains in, else bfloat16."""
    from megarl.models.hf_files import config_dtype

    named = config_dtype(hf_config)
    return named if named in DTYPES else "bfloat16"


def _verified(checked: int | None) -> str:
    if checked is None:
        return "not verified (--no-verify)"
    return f"verified: {checked} parameters loaded back from the written files equal the converted ones bit for bit"


def _write_manifest(written: Path, source: str, step: int | None, checked: int | None) -> None:
    import megarl

    files = sorted(str(p.relative_to(written)) for p in written.rglob("*") if p.is_file())
    manifest = {"kind": "megarl convert", "megarl_version": megarl.__version__, "checkpoint": source,
                "step": step, "verified_parameters": checked, "files": files}
    (written / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
