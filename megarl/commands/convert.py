"""`megarl convert`: models between Hugging Face and Megatron formats, verified bit for bit.

- ``megarl convert megatron-to-hf --ckpt CKPT --out HF_DIR`` (short form: ``megarl convert CKPT
  HF_DIR``): CKPT is a training checkpoint (a step_NNNNNN directory: its policy, rebuilt with the
  run's layout) or a model checkpoint of hf-to-megatron (rebuilt with its recorded layout or
  --tp/--pp/--ep/--etp). HF safetensors + index, config (naming the dtype written), generation config and tokenizer are written,
  imported back and compared with the loaded weights bit for bit (--no-verify skips that).
  A LoRA run's checkpoint (policy/lora_base.json; adapters only) is loaded onto its base model
  (the run's model.path, checked against the recorded fingerprint): HF_DIR is the merged model,
  and HF_DIR/lora_adapter the adapters as an HF PEFT adapter of that base (--no-adapter: not).
- ``megarl convert hf-to-megatron --hf HF_DIR --out CKPT --tp N --pp M [--ep E] [--etp T]``: a Megatron
  dist-checkpoint that records the HF config it came from (megarl/checkpoint/model_checkpoint.py);
  `megarl launch` starts from it when model.path names it, with any TP/PP. It is loaded back
  and compared with the HF import bit for bit.

The conversions themselves are megarl/commands/conversion.py (`megarl generate` runs them too).
The worker processes (megarl/actors/conversion_rank.py) run under Ray: the training
layout's placement for a training checkpoint, TP x PP CPU processes on this machine for a model
conversion (each rank reads and holds only its slices of the weights). With --in-process, a
layout of one rank runs in this process instead, without Ray (a one-GPU box under torchrun, or
where Ray is not installed): the same rank code, on this process's device. Nothing the user owns is
ever deleted: OUT is checked before Ray starts, written next to itself and swapped in once
verified (megarl/commands/model_outputs.py says how); OUT may not be the model directory it is
converted from either, and a failure leaves OUT as it was (the worker logs are kept, and named
in the error). Relative paths in a training checkpoint's config (model.path) resolve against
the directory the run was launched from (recorded in the checkpoint), not the caller's.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from megarl.commands.arguments import user_path
from megarl.commands.conversion import (
    DTYPES,
    check_hf_import,
    convert_checkpoint,
    convert_hf_to_megatron,
    export_model_checkpoint,
)
from megarl.commands.outputs import OutputError
from megarl.commands.supervision import Supervision, starts_ray, supervised_command
from megarl.disk_full import writing

DIRECTIONS = ("hf-to-megatron", "megatron-to-hf")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert models between Hugging Face and Megatron formats (verified bit for bit)",
        description="Convert a model between Hugging Face and Megatron formats. Every conversion loads what it "
        "wrote back and checks every parameter bit for bit (megatron-to-hf --no-verify skips it); OUT is written next to itself and swapped in only "
        "once verified. Short form: `megarl convert CHECKPOINT OUT` = `megarl convert megatron-to-hf --ckpt "
        "CHECKPOINT --out OUT`.",
        epilog="examples:\n"
        "  megarl convert outputs/run/checkpoints/step_000200 hf_model\n"
        "  (a LoRA run's checkpoint: hf_model is the merged model, hf_model/lora_adapter the PEFT adapter)\n"
        "  megarl convert hf-to-megatron --hf Qwen2.5-7B --out qwen7b_tp2pp2 --tp 2 --pp 2\n"
        "  megarl launch configs/qwen2.5_7b_ppo.yaml model.path=qwen7b_tp2pp2\n"
        "  megarl convert megatron-to-hf --ckpt qwen7b_tp2pp2 --out qwen7b_hf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    directions = p.add_subparsers(dest="direction", metavar="DIRECTION")
    directions.required = True
    _register_to_megatron(directions)
    _register_to_hf(directions)


def _register_to_megatron(directions: argparse._SubParsersAction) -> None:
    p = directions.add_parser(
        "hf-to-megatron",
        help="an HF model directory -> a Megatron dist-checkpoint that `megarl launch` starts from",
        description="Load an HF model (safetensors) into a Megatron model with --tp x --pp ranks (CPU processes; "
        "each reads only its slices; a mixture-of-experts model's experts split over --ep ranks, with the data-parallel "
        "replicas that takes), save it as a Megatron dist-checkpoint in OUT with the HF config and "
        "tokenizer, load it back and compare every parameter bit for bit. Set model.path (or critic.path) to OUT "
        "to train from it with any TP/PP layout.",
    )
    p.add_argument("--hf", required=True, type=user_path, metavar="HF_DIR", help="the HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, type=user_path, metavar="CKPT_DIR", help="the checkpoint directory to write (new or empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the conversion (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages of the conversion (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks of a mixture-of-experts model (default 1; "
                   "each holds num_experts / ep experts; the conversion adds the data-parallel replicas Megatron needs "
                   "for ep to divide tp x dp)")
    p.add_argument("--etp", type=int, default=1, help="expert-tensor-parallel ranks of a mixture-of-experts model "
                   "(default 1; each expert's gate/up rows and down columns split over etp ranks; ep x etp must divide "
                   "tp x dp)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype (default: the HF config's dtype, else bfloat16)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT when it holds a previous hf-to-megatron output (and nothing else)")
    _add_in_process(p)
    p.set_defaults(handler=supervised_command(_run_to_megatron, _prepare_to_megatron))


def _add_in_process(p: argparse.ArgumentParser) -> None:
    p.add_argument("--in-process", action="store_true",
                   help="no Ray: convert with one rank in this process, on its device (a layout of one rank: TP=1, PP=1, "
                   "which a model checkpoint of any layout exports with; a training checkpoint of a one-rank run)")


def _register_to_hf(directions: argparse._SubParsersAction) -> None:
    p = directions.add_parser(
        "megatron-to-hf",
        help="a training checkpoint or a Megatron model checkpoint -> an HF model directory",
        description="Rebuild the model (a training checkpoint's policy with the run's layout, or a model checkpoint "
        "of hf-to-megatron with its recorded layout or --tp/--pp), write HF safetensors + index with the config "
        "(its dtype set to the written tensors'), generation config and tokenizer, then import the written files back and check every parameter equals "
        "the loaded one bit for bit. --ckpt and --out are required; `megarl convert CKPT OUT` is the short form.",
    )
    p.add_argument("--ckpt", default=None, type=user_path, help="a step_NNNNNN training checkpoint (a torn one is refused) or a "
                   "model checkpoint of hf-to-megatron")
    p.add_argument("--out", default=None, type=user_path, metavar="HF_DIR", help="the HF model directory to write (new or empty)")
    p.add_argument("--config", default=None, type=user_path, help="training checkpoint: the run's config (default: the config.yaml "
                   "saved in the checkpoint); its model.dtype is the export's (a note says when the run trained in another)")
    p.add_argument("--tp", type=int, default=None, help="model checkpoint: TP of the export (default: recorded)")
    p.add_argument("--pp", type=int, default=None, help="model checkpoint: PP of the export (default: recorded)")
    p.add_argument("--ep", type=int, default=None, help="model checkpoint: EP of the export (default: recorded)")
    p.add_argument("--etp", type=int, default=None, help="model checkpoint: ETP of the export (default: recorded)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="import the written files back and compare bit for bit (default: on)")
    p.add_argument("--adapter", action=argparse.BooleanOptionalAction, default=None,
                   help="LoRA training checkpoint (actor.lora): OUT is always the merged model (base + alpha/rank * B A); "
                   "also write the adapters as an HF PEFT adapter directory OUT/lora_adapter (adapter_config.json + "
                   "adapter_model.safetensors, base_model_name_or_path = the run's HF model.path), which "
                   "PeftModel.from_pretrained(base, OUT/lora_adapter) loads (default: on for a LoRA checkpoint; "
                   "--no-adapter: the merged model alone)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT when it holds a previous megatron-to-hf output (and nothing else)")
    _add_in_process(p)
    p.set_defaults(handler=supervised_command(_run_to_hf, _prepare_to_hf))


# Options of megatron-to-hf that take a value (the short form's bare words are the others).
_VALUED = {"--config", "--tp", "--pp", "--ep", "--etp", "--ckpt", "--out"}


def expand_short_form(argv: list[str]) -> list[str]:
    """``convert [opts] CKPT [opts] OUT [opts]`` -> ``convert megatron-to-hf [opts] --ckpt CKPT --out
    OUT`` (the form before directions); anything else is left to argparse."""
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)
    if i is None or argv[i] != "convert":
        return argv
    rest = argv[i + 1 :]
    if any(a in DIRECTIONS for a in rest) or not rest or any(a in ("-h", "--help") for a in rest):
        return argv
    bare: list[str]
    options, bare, k = [], [], 0
    while k < len(rest):
        a = rest[k]
        if a in _VALUED and k + 1 < len(rest):
            options += [a, rest[k + 1]]
            k += 2
            continue
        (options if a.startswith("-") else bare).append(a)
        k += 1
    if not bare:
        return argv  # argparse says what is missing
    named = ["--ckpt", bare[0]] + (["--out", bare[1]] if len(bare) > 1 else [])
    return [*argv[: i + 1], "megatron-to-hf", *options, *named, *bare[2:]]


_STOPPED = "while converting; OUT is as it was (the staging folder is removed); run the same command again"
_KEPT = "OUT as it was (the staging folder is removed)"


def _kept(out: str) -> str:
    """What a driver that dies without a word leaves (the supervisor's line): OUT is swapped in
    only once verified (megarl/commands/model_outputs.py)."""
    return (f"{out} is as it was (a conversion writes beside it and swaps it in only once verified; the next convert "
            "to it removes the staging folder left): run the same command again")


def _prepare_to_megatron(args: argparse.Namespace) -> Supervision:
    """The HF directory and OUT checked in the command's process, before any driver starts."""
    from megarl.trainer.run_lock import output_lock

    check_hf_import(args.hf, args.out, args.overwrite)
    return Supervision(_kept(args.out), ray=starts_ray(args), user_code=None,  # a conversion runs no user code
                       holds=partial(output_lock, args.out))  # one convert writes OUT


def _prepare_to_hf(args: argparse.Namespace) -> Supervision:
    """The arguments and the checkpoint checked in the command's process, before any driver
    starts (OUT is checked by the driver: a training checkpoint's run config says what it may not be)."""
    from megarl.trainer.run_lock import output_lock

    _checked_source(args, check_files=True)
    return Supervision(_kept(args.out), ray=starts_ray(args), user_code=None,  # a conversion runs no user code
                       holds=partial(output_lock, args.out))  # one convert writes OUT


def _run_to_megatron(args: argparse.Namespace) -> int:
    from megarl.trainer.run_lock import output_lock
    from megarl.trainer.watchdog import run_stoppable

    with output_lock(args.out), writing(args.out, "the converted checkpoint", kept=_KEPT):  # one convert writes OUT
        run_stoppable(lambda: convert_hf_to_megatron(args.hf, args.out, args.tp, args.pp, args.dtype, args.overwrite, report=print,
                                                     in_process=args.in_process, ep=args.ep, etp=args.etp), _STOPPED)  # fmt: skip
    return 0


def _run_to_hf(args: argparse.Namespace) -> int:
    from megarl.trainer.run_lock import output_lock
    from megarl.trainer.watchdog import run_stoppable

    _check_both_given(args)
    with output_lock(args.out), writing(args.out, "the converted model", kept=_KEPT):  # one convert writes OUT
        return run_stoppable(lambda: _to_hf(args), _STOPPED)


def _check_both_given(args: argparse.Namespace) -> None:
    if args.ckpt is None or args.out is None:
        raise OutputError("megatron-to-hf needs --ckpt CHECKPOINT and --out HF_DIR (or: megarl convert CHECKPOINT HF_DIR)")


def _checked_source(args: argparse.Namespace, *, check_files: bool = False) -> bool:
    """megatron-to-hf's arguments against its --ckpt, and with ``check_files`` the checkpoint
    itself (a missing, torn or unreadable one refused; the export checks it again as it loads it);
    whether it is a model checkpoint (else a training checkpoint)."""
    ckpt = args.ckpt
    from megarl.checkpoint.model_checkpoint import check_model_checkpoint, is_model_checkpoint
    from megarl.checkpoint.verification import verify_checkpoint

    _check_both_given(args)
    if (Path(ckpt) / "config.json").is_file() and not (Path(ckpt) / "manifest.json").is_file() and not is_model_checkpoint(ckpt):
        raise OutputError(f"{ckpt} is a Hugging Face model directory, not a checkpoint; to make a Megatron "
                          f"checkpoint of it: megarl convert hf-to-megatron --hf {ckpt} --out CKPT_DIR")
    if is_model_checkpoint(ckpt):
        if args.config is not None or args.adapter:
            raise OutputError(f"--{'config' if args.config is not None else 'adapter'} is for training checkpoints; {ckpt} is a "
                              "model checkpoint (a plain model, with its own config)")  # fmt: skip
        if check_files:
            check_model_checkpoint(Path(ckpt).absolute())
        return True
    if any(v is not None for v in (args.tp, args.pp, args.ep, args.etp)):
        raise OutputError(f"--tp/--pp/--ep/--etp are for model checkpoints; a training checkpoint ({ckpt}) is exported with "
                          "the run's layout")
    if check_files:
        verify_checkpoint(ckpt)
    return False


def _to_hf(args: argparse.Namespace) -> int:
    ckpt, out = args.ckpt, args.out
    if _checked_source(args):
        export_model_checkpoint(ckpt, out, args.tp, args.pp, args.overwrite, args.verify, report=print,
                                in_process=args.in_process, ep=args.ep, etp=args.etp)  # fmt: skip
    else:
        convert_checkpoint(ckpt, out, args.config, args.overwrite, report=print, verify=args.verify, in_process=args.in_process,
                           adapter=args.adapter)  # fmt: skip
    return 0


