"""`megarl generate CONFIG --data IN.parquet --out OUT.parquet [--n N] [KEY=VALUE ...]`:
N responses per prompt with the configured engine, resumable.

- The model: ``--model`` or ``model.path``; an HF directory is used as it is, a model
  checkpoint (`megarl convert hf-to-megatron`) or a training checkpoint (a step_NNNNNN
  directory) is first exported to HF files in ``OUT.parquet.partial/model`` through the
  `megarl convert` path (verified bit for bit), since the engines load HF directories; under Ray,
  or with --in-process in this process (a layout of one rank; a box without Ray).
- The engine: ``rollout.engine``. torch: one engine in this process (the CPU, or the first GPU
  with cluster.device=cuda); sglang: one server per ``rollout.tp`` of this machine's visible
  GPUs (CUDA_VISIBLE_DEVICES), prompts spread over them.
- Sampling: ``rollout.sampling`` (``--temperature``, ``--top-p``, ``--max-new-tokens`` and
  ``--n`` are shortcuts; ``n`` defaults to rollout.n); the prompts are templated and truncated
  as in training (``data.*``); ``rollout.generate_function`` makes the responses.
- Nothing lost: the prompts go in parts of ``--batch-size``, each written as
  ``OUT.parquet.partial/part-NNNNNN.parquet`` when it is done; a re-run with the same settings
  and model (everything that changes what is generated, the model's weights included: see
  ``generate_partial.job_record``) skips the written parts, each checked by its footer first (a crash loses at most the
  part in flight), and part i is sampled with a seed derived from (trainer.seed, i), so a resumed file equals an uninterrupted one on
  a seeded engine. At the end the parts are merged into OUT by rename and the partial directory
  is removed. An existing OUT is replaced only with --overwrite; a partial directory made with
  other settings is refused, never removed, unless it holds no finished part (nor a staged
  export of another model): then there is nothing to continue and it starts afresh.
- Checked before any work: the output path, the model, the user's code it runs (generate
  function, tool parser, agent loops and files), each row's agent_name and extra_info against
  rollout.agent (as a launch checks its data files), every prompt against
  data.max_prompt_length, and data.max_prompt_length + max_new_tokens against the model's
  positions (as `megarl plan` checks RL rollouts).
- A generated or scored file as --data: its generated columns (prompt_text, responses, ...,
  scores) are replaced by this generation's.

The output format is megarl/data/generated.py; `megarl evaluate` scores it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from megarl.commands.arguments import add_config_args, user_path
from megarl.commands.generate_partial import (
    MODEL_DIR,
    PARTIAL_SUFFIX,
    GenerateError,
    check_parts,
    job_record,
    merge_parts,
    merged_before,
    open_partial,
    part_path,
    parts_of,
    remove_partial,
)
from megarl.commands.outputs import (
    check_folder,
    check_new_file,
    check_outside_checkpoints,
    same_file,
)
from megarl.commands.supervision import (
    Hold,
    Supervision,
    driver_user_code,
    starts_ray,
    supervised_command,
)
from megarl.disk_full import writing
from megarl.trainer.watchdog import RunControl

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample responses for a prompt file offline (resumable), from an HF model or a megarl checkpoint",
        description="Writes OUT.parquet: the rows of --data plus prompt_text, responses (n per prompt), "
        "response_lengths, finish_reasons, turns and tool_calls (per response; agent loops, docs/agents.md), sampled "
        "with the config's engine and rollout (sampling, agent). The model is "
        "--model or model.path: an HF directory, a model checkpoint or a training checkpoint (step_NNNNNN, exported "
        "to HF files first). Parts are written to OUT.parquet.partial as they finish; running the same command again "
        "after a crash or Ctrl-C goes on where it stopped. `megarl evaluate --data OUT.parquet` scores the result.",
    )
    add_config_args(p)
    p.add_argument("--data", type=user_path, required=True, help="prompt parquet in the verl schema (like data.val_files)")
    p.add_argument("--out", type=user_path, required=True, help="output parquet (OUT.parquet.partial holds the parts until the end)")
    p.add_argument("--model", type=user_path, default=None, help="HF directory, model checkpoint or training checkpoint (default: model.path)")
    p.add_argument("--n", type=int, default=None, help="responses per prompt (default: rollout.n)")
    p.add_argument("--temperature", type=float, default=None, help="rollout.sampling.temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="rollout.sampling.top_p")
    p.add_argument("--max-new-tokens", type=int, default=None, help="rollout.sampling.max_new_tokens")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per part: what a crash can lose (default 64)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--in-process", action="store_true",
                   help="no Ray: a checkpoint's export to HF files runs with one rank in this process (as `megarl "
                   "convert --in-process`; a layout of one rank)")  # fmt: skip
    p.set_defaults(handler=supervised_command(_run, _prepare, holds=_held_out))


def _held_out(args: argparse.Namespace) -> Hold:
    """OUT, held from the command's first moment: a second generate into it is refused at once."""
    from megarl.trainer.run_lock import output_lock

    return output_lock(args.out)


def _prepare(args: argparse.Namespace) -> Supervision:
    """The flags, the config, OUT and the model checked in the command's process, before any
    driver starts; Ray starts only to export a checkpoint (an HF directory is used as it is)."""
    _check_flags(args)
    cfg, target, source = _checked_request(args.config, _overrides(args), Path(args.data), args.out, args.model, args.batch_size)
    partial_dir = target.with_name(target.name + PARTIAL_SUFFIX)
    kept = f"the parts finished so far are kept in {partial_dir}: the same command goes on from them"
    return Supervision(kept, ray=starts_ray(args) and _model_export(Path(source)) is not None,
                       user_code=driver_user_code(cfg, dataset=False))  # --data, not data.custom_cls


def _run(args: argparse.Namespace) -> int:
    _check_flags(args)
    generate(args.config, _overrides(args), args.data, args.out, model=args.model, batch_size=args.batch_size,
             overwrite=args.overwrite, in_process=args.in_process)  # fmt: skip
    print(f"wrote {args.out}")
    return 0


def _overrides(args: argparse.Namespace) -> list[str]:
    """The config's overrides with the shortcut flags' (--n: rollout.n=...)."""
    shortcuts = {"rollout.n": args.n, "rollout.sampling.temperature": args.temperature,
                 "rollout.sampling.top_p": args.top_p, "rollout.sampling.max_new_tokens": args.max_new_tokens}  # fmt: skip
    return [*args.overrides, *(f"{key}={value}" for key, value in shortcuts.items() if value is not None)]


def _check_flags(args: argparse.Namespace) -> None:
    """The shortcut flags' bounds, named by the flag (the config's check would name the override
    it becomes, rollout.n=0, which the user never wrote)."""
    bad = [f"{flag} {value}: {need}" for flag, value, ok, need in (
        ("--n", args.n, lambda v: v >= 1, "give the number of responses per prompt, 1 or more"),
        ("--max-new-tokens", args.max_new_tokens, lambda v: v >= 1, "give 1 or more"),
        ("--temperature", args.temperature, lambda v: v >= 0, "give 0 (greedy) or more"),
        ("--top-p", args.top_p, lambda v: 0 < v <= 1, "give a number in (0, 1]"),
        ("--batch-size", args.batch_size, lambda v: v >= 1, "give the prompts per part, 1 or more"),
    ) if value is not None and not ok(value)]  # fmt: skip
    if bad:
        raise GenerateError("; ".join(bad))


def generate(config: str | Path, overrides: list[str], data: str | Path, out: str | Path, *, model: str | None = None,
             batch_size: int = 64, overwrite: bool = False, in_process: bool = False) -> Path:  # fmt: skip
    """Generate for every prompt of ``data`` into ``out`` (see the module docstring); ``in_process``:
    a checkpoint is exported without Ray (`megarl convert --in-process`)."""
    from megarl.trainer.run_lock import output_lock

    cfg, target, source = _checked_request(config, overrides, Path(data), out, model, batch_size)
    with output_lock(target):  # a second generate into OUT is refused: it would continue this one's partial folder
        return _generate(cfg, Path(data), target, source, batch_size=batch_size, overwrite=overwrite, in_process=in_process)


def _checked_request(config: str | Path, overrides: list[str], data: Path, out: str | Path, model: str | None,
                     batch_size: int) -> tuple[Any, Path, str]:  # fmt: skip
    """The config (overrides applied), OUT (absolute) and the model (absolute), each checked as
    far as it can be before OUT is held. First of all, another generate writing OUT: refused before
    the config, the model's checks and (in the command's process) the driver's start."""
    from megarl.checkpoint.verification import CHECKPOINTS_DIR
    from megarl.config.loading import load_config
    from megarl.rollout_sglang.cpu_venv import with_cpu_server_python
    from megarl.trainer.run_lock import check_output_free

    check_output_free(out)
    cfg = with_cpu_server_python(load_config(config, overrides))  # SGLang on CPU: as `megarl demo` finds it
    if not model and not cfg.model.path:
        raise GenerateError("no model: set model.path in the config or give --model")
    target = Path(out).absolute()
    _check_target(target, data, batch_size, Path(cfg.trainer.output_dir) / CHECKPOINTS_DIR)
    return cfg, target, str(Path(model or cfg.model.path or "").absolute())


def _generate(cfg: Any, data: Path, target: Path, source: str, *, batch_size: int, overwrite: bool, in_process: bool) -> Path:
    """generate()'s work, while it holds OUT."""
    from megarl.commands.conversion import check_in_process, convert_checkpoint
    from megarl.data.datasets import read_prompt_file
    from megarl.models.hf_files import tokenizer_files_problem
    from megarl.user_code import user_output_to

    partial_dir = target.with_name(target.name + PARTIAL_SUFFIX)
    job = job_record(cfg, Path(data), source, batch_size)
    if target.exists() and not overwrite and merged_before(partial_dir, job):
        log.info("%s was merged by an earlier run that stopped before removing %s; removing it now", target, partial_dir)
        remove_partial(partial_dir)
        return target
    check_new_file(target, overwrite)
    records = read_prompt_file(data, label="--data", prompt_key=cfg.data.prompt_key, source_key=cfg.data.reward_fn_key)  # checked before any work
    export = _model_export(Path(source))  # refused before anything is written
    run_model = _run_model(Path(source), export, cfg)
    if in_process and export is convert_checkpoint:
        check_in_process(source)  # a run of several ranks cannot be exported in this process
    _check_positions(cfg, source, run_model)
    _note_replaced_columns(Path(data))
    # a training checkpoint has no tokenizer files: its run's model's (what the export copies)
    tokenizer_dir = run_model if tokenizer_files_problem(Path(source)) else source
    _check_prompts(cfg, records, tokenizer_dir)
    _check_user_code(cfg)
    _check_agent_rows(cfg, Path(data), records)
    _check_sglang(cfg)
    _warn_greedy_copies(cfg)
    open_partial(partial_dir, job)
    parts = parts_of(len(records), batch_size)
    check_parts(partial_dir, parts)
    todo = [i for i in range(len(parts)) if not part_path(partial_dir, i).is_file()]
    control = RunControl()  # Ctrl-C / SIGTERM: the servers are shut down, the written parts stay
    full = {"kept": f"the finished parts in {partial_dir}", "fix": "free space on that disk, then run the same command: it goes on from them"}
    try:
        with control.handlers(), writing(partial_dir, "the generation's parts (and the staged model)", **full):
            if todo:
                model_dir = _hf_model(Path(source), export, partial_dir / MODEL_DIR, in_process)
                control.reclaim()  # an export ran under Ray, which installs its own SIGTERM handler
                with user_output_to(user_code_log(target), cfg.reward.output_log_max_mb):  # what a generate function or a tool prints
                    _generate_parts(cfg, model_dir, Path(data), records, parts, todo, partial_dir)
    except KeyboardInterrupt:
        done = sum(1 for i in range(len(parts)) if part_path(partial_dir, i).is_file())
        raise control.stopped(f"stopped by {control.signal_name}: {done} of {len(parts)} parts are in {partial_dir}; run the "
                              "same command to go on") from None  # fmt: skip
    with writing(target, "the merged output", **full):
        merge_parts(partial_dir, len(parts), target)
    remove_partial(partial_dir)
    return target


def user_code_log(target: Path) -> Path:
    """Where the user's code's prints go: ``<OUT>.user_code.log`` beside OUT (written only if it printed)."""
    return target.with_name(target.name + ".user_code.log")


def _check_target(target: Path, data: Path, batch_size: int, checkpoints: Path) -> None:
    """--out and --batch-size, checked before OUT is held (whether OUT exists: once held)."""
    if batch_size < 1:
        raise GenerateError(f"--batch-size ({batch_size}) must be >= 1")
    if target.suffix != ".parquet":
        raise GenerateError(f"--out {target} must end in .parquet")
    if same_file(target, data):  # replacing it would replace the input, however --out spells it
        raise GenerateError(f"--out {target} is the input file; give another path")
    check_outside_checkpoints(target, runs=[checkpoints])  # OUT.parquet.partial goes beside it
    check_folder(target)


def _model_export(source: Path) -> Any:
    """How ``source`` becomes an HF directory: None (it is one), or the `megarl convert` function
    that exports it (a model checkpoint, a training checkpoint)."""
    from megarl.checkpoint.model_checkpoint import is_model_checkpoint, sft_output_hint
    from megarl.checkpoint.verification import run_folder_problem
    from megarl.commands.conversion import convert_checkpoint, export_model_checkpoint
    from megarl.models.hf_files import tokenizer_files_problem
    from megarl.models.weight_files import HF_WEIGHT_SUFFIXES, has_hf_weights

    if is_model_checkpoint(source):
        return export_model_checkpoint
    if (source / "manifest.json").is_file():  # a training checkpoint (step_NNNNNN)
        return convert_checkpoint
    if (source / "config.json").is_file():  # the engines load it as it is: its files are checked now
        problem = tokenizer_files_problem(source)
        if problem:  # transformers would build another tokenizer from config.json alone
            raise GenerateError(f"model {source} {problem}; copy the model's tokenizer files into it")
        if not has_hf_weights(source):  # else an OSError traceback at the engine's start
            raise GenerateError(f"model {source} has no weight files (*{' or *'.join(HF_WEIGHT_SUFFIXES)}); copy the "
                                "model's weights into it, or give a complete HF directory")  # fmt: skip
        problem = _hf_tensors_problem(source)
        if problem:
            raise GenerateError(f"model {source} {problem}; give a complete HF directory")
        return None
    problem = run_folder_problem(source)
    if problem:
        raise GenerateError(f"model {problem}")
    raise GenerateError(f"model {source} is not an HF model directory (config.json), a model checkpoint or a "
                        f"training checkpoint (step_NNNNNN); {sft_output_hint(source) or 'give one with --model or model.path'}")  # fmt: skip


def _hf_tensors_problem(source: Path) -> str | None:
    """What `megarl launch` checks of an HF model.path's safetensors, for a config megarl's bridge
    takes: transformers fills a missing tensor with random values and the engine generates on
    (its load report says so among the logs); a cut file is a traceback. A config the bridge
    refuses (a quantized model, biases megarl does not train), an architecture without a bridge
    and .bin weights are left to the engine, which may load them."""
    from megarl.models.bridges import ModelRefused, check_hf_model

    if not any(source.glob("*.safetensors")):
        return None
    try:
        check_hf_model(str(source))
    except ModelRefused as exc:
        if exc.part == "weights":
            return f"does not hold the weights its config.json implies ({exc})"
    return None


def _run_model(source: Path, export: Any, cfg: Any) -> str:
    """The HF directory of the model ``source`` was trained from, whose config and tokenizer it
    has (a training checkpoint holds neither): for a training checkpoint, its run's model.path as
    `megarl convert` finds it (the config saved in the checkpoint, relative paths against the
    run's launch directory), so that the export and these checks read the same model from any
    directory; else the config's model.path."""
    from megarl.checkpoint.run_record import model_config_change, run_config
    from megarl.checkpoint.verification import verify_checkpoint
    from megarl.commands.conversion import convert_checkpoint

    if export is convert_checkpoint:
        ckpt = verify_checkpoint(source)
        run_model = str(run_config(ckpt).model.path)
        changed = model_config_change(ckpt, run_model)  # what the export would write beside the weights
        if changed:
            raise GenerateError(changed)
        return run_model
    return str(cfg.model.path)


def _check_positions(cfg: Any, source: str, run_model: str) -> None:
    """The planner's rule for RL rollouts: data.max_prompt_length (the longest prompt) plus
    max_new_tokens must fit the model's positions, else responses are cut short."""
    from megarl.config.architectures import ArchError, resolve_arch
    from megarl.plan.rollout_checks import check_positions

    # a checkpoint's HF config: beside a model checkpoint, else the run's model
    hf_dir = source if (Path(source) / "config.json").is_file() else run_model
    try:
        arch = resolve_arch(hf_dir, cfg.model.arch)
    except ArchError:  # no config to read the positions from: the export and the engine decide
        return
    issue = check_positions(cfg, arch, new_tokens="--max-new-tokens")
    if issue is not None:
        raise GenerateError(str(issue))


def _note_replaced_columns(data: Path) -> None:
    """A generated (or scored) file as --data: its responses belong to another generation, so
    the output has this generation's in their place (no stale columns beside the new ones)."""
    import pyarrow.parquet as pq

    from megarl.data.generated import GENERATED_COLUMNS

    stale = [c for c in GENERATED_COLUMNS if c in pq.read_schema(data).names]
    if stale:
        log.info("--data %s already holds %s from an earlier generation; the output has this generation's instead",
                 data, ", ".join(stale))  # fmt: skip


def _check_prompts(cfg: Any, records: list[Any], tokenizer_dir: str) -> None:
    """Every prompt must fit data.max_prompt_length unless data.truncation cuts it (generate
    answers every row: it filters nothing), checked before any engine starts."""
    from transformers import AutoTokenizer

    if not records:
        raise GenerateError("--data has no rows")
    if cfg.data.truncation != "error":
        return
    from megarl.data.prompts import PromptBuilder
    from megarl.rollout.agents.tools import prompt_tools

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except OSError as exc:  # e.g. a model.path that is not there: a user's path, not a crash
        raise GenerateError(f"no tokenizer could be loaded from {tokenizer_dir} ({str(exc).splitlines()[0]}); a model "
                            "without tokenizer files takes model.path's: give an HF directory with them") from None  # fmt: skip
    builder = PromptBuilder.from_config(cfg.data, tokenizer, prompt_tools(cfg))
    too_long = builder.overlong([r.prompt for r in records])
    over = [r.row for r, drop in zip(records, too_long, strict=True) if drop]
    if over:
        raise GenerateError(f"{len(over)} prompts of --data are longer than data.max_prompt_length "
                            f"({cfg.data.max_prompt_length} tokens), the first row {over[0]}; "
                            "raise data.max_prompt_length, or set data.truncation=left|right")  # fmt: skip


def _check_user_code(cfg: Any) -> None:
    """The user's code the generation runs (rollout.generate_function; the agent's tool parser,
    loops, tool and interaction files), loaded before the partial directory is made: a wrong
    name is one line, not a traceback after the start."""
    from megarl.plan.extensions import import_problem, named_functions

    for field, name in named_functions(cfg):
        problem = import_problem(field, name) if field.startswith("rollout.") else None  # algorithm.*: training's
        if problem:
            raise GenerateError(f"{field}: {problem}")


def _check_agent_rows(cfg: Any, data: Path, records: list[Any]) -> None:
    """The rows' agent_name and extra_info against rollout.agent, as a launch checks its data
    files: an unknown loop is one line now, not an error once the parts before its row are
    generated (which the corrected file, other contents, could not continue)."""
    from megarl.data.datasets import file_label
    from megarl.rollout.agents.checks import row_findings

    if cfg.rollout.generate_function != "default":  # a user's function: the agent settings are not used
        return
    findings = row_findings(cfg.rollout.agent, [(file_label("--data", data), str(data), records)])
    for field, message, level in sorted(findings, key=lambda f: f[2] != "error"):  # the errors first
        if level == "error":
            raise GenerateError(f"{field}: {message}")
        log.warning("%s: %s", field, message)


def _warn_greedy_copies(cfg: Any) -> None:
    """Several greedy responses per prompt are one response n times (`megarl plan` says the same
    of greedy validation): pass@k of the file would be its pass@1."""
    from megarl.evaluation import greedy_copies_note

    n, temperature = cfg.rollout.n, cfg.rollout.sampling.temperature
    if temperature == 0 and n > 1:
        log.warning("--n %d (temperature 0): %s; sample them (--temperature > 0), or use --n 1", n, greedy_copies_note(n))


def _check_sglang(cfg: Any) -> None:
    """rollout.engine=sglang: the checks `megarl launch` makes of the servers (the interpreter
    has SGLang; no deterministic mode on CPU), before the partial directory is made; otherwise
    the first server's start fails seconds later with SGLang's traceback."""
    from megarl.plan.issues import Issue
    from megarl.plan.rollout_checks import check_deterministic, check_server_python

    issues: list[Issue] = []
    check_server_python(cfg, issues)
    check_deterministic(cfg, issues)
    if issues:
        raise GenerateError("; ".join(str(issue) for issue in issues))


def _hf_model(source: Path, export: Any, staged: Path, in_process: bool) -> Path:
    """An HF directory the engines load: ``source`` itself, or its export to ``staged``."""
    from megarl.commands.model_outputs import EXPORT_MANIFEST

    if export is None:
        return source
    if (staged / EXPORT_MANIFEST).is_file():
        log.info("using the HF export staged in %s", staged)
        return staged
    log.info("exporting %s to HF files in %s (the engines load HF directories)", source, staged)
    export(source, staged, report=print, in_process=in_process)
    return staged


def _generate_parts(cfg: Any, model_dir: Path, data: Path, records: list[Any], parts: list[range], todo: list[int],
                    partial: Path) -> None:  # fmt: skip
    """Generate the parts in ``todo``, writing each as soon as it is done."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from megarl.data.prompts import PromptBuilder
    from megarl.engines.base import eos_token_ids
    from megarl.progress import counting
    from megarl.rollout.agents.tools import prompt_tools
    from megarl.rollout.generate import make_generate

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eos = eos_token_ids(model_dir, tokenizer)
    builder = PromptBuilder.from_config(cfg.data, tokenizer, prompt_tools(cfg))
    produce = make_generate(cfg, tokenizer, eos)
    table = pq.read_table(data)
    done = sum(len(p) for i, p in enumerate(parts) if i not in todo)
    with open_engines(cfg, model_dir, partial / "logs") as engines, \
            counting(len(records), "generating", "prompts", done=done) as advance:  # fmt: skip
        for index in todo:
            rows = parts[index]
            batch = produce(engines, _prompt_batch(records, rows, builder), _sampling(cfg, index))
            _write_part(part_path(partial, index), table.slice(rows.start, len(rows)), batch, tokenizer, eos)
            advance(len(rows))


def _prompt_batch(records: list[Any], rows: range, builder: Any) -> Any:
    from megarl.data.prompt_batch import PromptBatch

    picked = [records[i] for i in rows]
    ids, texts = builder.encode([r.prompt for r in picked], [f"--data: row {r.row}" for r in picked])
    return PromptBatch(prompt_ids=ids, prompt_text=texts, data_source=[r.data_source for r in picked],
                       ground_truth=[r.ground_truth for r in picked], extra_info=[dict(r.extra_info) for r in picked],
                       index=[r.row for r in picked], file_index=[0] * len(picked),
                       agent_name=[r.agent_name for r in picked], raw_prompt=[r.prompt for r in picked])  # fmt: skip


def _sampling(cfg: Any, part: int) -> Any:
    """rollout.sampling with part ``part``'s own seed (the same part always samples the same)."""
    from megarl.engines.base import SamplingParams
    from megarl.engines.seeds import step_seed

    s = cfg.rollout.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          n=cfg.rollout.n, stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
                          ignore_eos=s.ignore_eos, seed=step_seed(cfg.trainer.seed, part))  # fmt: skip


def _write_part(path: Path, rows: Any, batch: Any, tokenizer: Any, eos: tuple[int, ...]) -> None:
    """The input rows plus the generated columns, written whole or not at all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.data.generated import (
        GENERATED_COLUMNS,
        LENGTHS,
        PROMPT_TEXT,
        REASONS,
        RESPONSES,
        TOOL_CALLS,
        TURNS,
    )
    from megarl.rollout.batching import response_texts

    texts = response_texts(batch, tokenizer, eos)
    agent = [e.get("agent") if isinstance(e, dict) else None for e in batch.extra_info] or [None] * len(batch)
    names = (RESPONSES, LENGTHS, REASONS, TURNS, TOOL_CALLS)  # every part the same columns (they are merged)
    per_prompt: list[dict[str, list]] = [{name: [] for name in names} for _ in range(rows.num_rows)]
    prompt_text = [""] * rows.num_rows
    for b, g in enumerate(batch.group_id.tolist()):
        values = {RESPONSES: texts[b], LENGTHS: int(batch.response_lengths[b]), REASONS: batch.finish_reason[b],
                  TURNS: (agent[b] or {}).get("turns", 1), TOOL_CALLS: (agent[b] or {}).get("tool_calls", 0)}  # fmt: skip
        for name in names:
            per_prompt[g][name].append(values[name])
        prompt_text[g] = batch.prompt_text[b]
    rows = rows.drop_columns([c for c in GENERATED_COLUMNS if c in rows.column_names])  # a generated file as input
    rows = rows.append_column(PROMPT_TEXT, pa.array(prompt_text, type=pa.string()))
    for name in names:
        kind = pa.list_(pa.string()) if name in (RESPONSES, REASONS) else pa.list_(pa.int64())
        rows = rows.append_column(name, pa.array([p[name] for p in per_prompt], type=kind))
    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(rows, tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk cut it)
        raise


@contextmanager
def open_engines(cfg: Any, model_dir: Path, log_dir: Path) -> Iterator[Any]:
    """The configured engines on this node, closed on exit: one torch engine in this process,
    or one SGLang server per ``rollout.tp`` of this machine's visible GPUs (one on a CPU)."""
    from megarl.progress import still_waiting

    if cfg.rollout.engine == "torch":
        from megarl.engines.torch_engine import TorchEngine

        device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
        with still_waiting(f"loading {model_dir} into the torch engine"):
            engine = TorchEngine(model_dir, device=device, dtype=cfg.model.dtype, max_running_requests=cfg.rollout.max_running_requests)
        yield engine
        return
    from megarl.rollout_sglang.controller import SGLangEngines
    from megarl.rollout_sglang.engine import SGLangEngine
    from megarl.rollout_sglang.server import SGLangServer, spec_from_config

    tp, cuda = cfg.rollout.tp, cfg.cluster.device == "cuda"
    gpus = _visible_gpus() if cuda else []
    if cuda and len(gpus) < tp:
        raise GenerateError(f"rollout.tp ({tp}) needs {tp} GPUs; this machine shows {len(gpus)} (CUDA_VISIBLE_DEVICES)")
    count = len(gpus) // tp if cuda else 1
    cluster = cfg.cluster.model_copy(update={"placement": "disaggregated"})  # nothing to hand memory over to
    log_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        servers = []
        for k in range(count):
            spec = spec_from_config(str(model_dir), cfg.rollout, cluster, gpu_ids=gpus[k * tp : (k + 1) * tp],
                                    seed=cfg.trainer.seed, dtype=cfg.model.dtype,
                                    log_path=str(log_dir / f"sglang_engine{k}.log"))  # fmt: skip
            server = SGLangServer(spec)
            stack.callback(server.shutdown)
            server.launch()
            servers.append(server)
        with still_waiting(f"starting {count} SGLang server(s) (logs: {log_dir})"):  # minutes on a big model
            for server in servers:
                server.wait_healthy()
        yield SGLangEngines([SGLangEngine(s, tp=tp, max_running_requests=cfg.rollout.max_running_requests) for s in servers])


def _visible_gpus() -> list[str]:
    """The physical ids of the GPUs this process may use (CUDA_VISIBLE_DEVICES, else all), as
    strings: indices or UUIDs (``GPU-...``), which a server's CUDA_VISIBLE_DEVICES takes alike."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
