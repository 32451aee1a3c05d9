"""`megarl data ...`: make and check prompt files in the verl parquet schema.

``register(subparsers)`` adds the ``data`` command to the main parser (megarl/cli.py). Each
handler returns an exit code; a data error prints ``error: <file: line/row, field, fix>`` and
returns 2 (the CLI's EXIT_USER). Heavy imports (pyarrow, transformers) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from megarl.commands.arguments import user_path

SCHEMA_TEXT = """\
The verl parquet schema (one row per prompt), which `megarl launch` reads:
  data_source   str                          selects the reward function (reward.functions)
  prompt        list of {role, content}      chat messages (or one plain string); role is
                                             system, user, assistant or tool; other keys
                                             (tool_calls, name, tool_call_id) go to the
                                             chat template
  ability       str                          free label, e.g. "math"
  reward_model  {ground_truth, style}        what the reward compares the response with
  extra_info    struct                       per-row metadata (split, index, ...; tools_kwargs
                                             and interaction_kwargs for agent loops)
  agent_name    str (optional)               the row's agent loop: single_turn (default),
                                             tool_agent or your own (docs/agents.md)
"""

DATA_EPILOG = (
    SCHEMA_TEXT
    + """
examples:
  megarl data gsm8k gsm8k/train.jsonl data/gsm8k_train.parquet
  megarl data math MATH/test.jsonl data/math_test.parquet --split test
  megarl data convert qa.csv data/qa.parquet --prompt-field q --answer-field a --data-source my_qa
  megarl data inspect data/gsm8k_train.parquet --tokenizer /models/Qwen2.5-7B-Instruct
  megarl data demo data/reverse            # the CPU demo's train.parquet + val.parquet
"""
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``megarl data`` and its subcommands to the main CLI's subparsers."""
    p = subparsers.add_parser(
        "data",
        help="convert raw JSONL/CSV to training parquet, inspect prompt files, write the demo data",
        description="Make and check prompt files in the verl parquet schema.",
        epilog=DATA_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    sub.required = True
    _add_gsm8k(sub)
    _add_math(sub)
    _add_convert(sub)
    _add_inspect(sub)
    _add_demo(sub)


def _parser(sub: argparse._SubParsersAction, name: str, help: str, description: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_io(p: argparse.ArgumentParser, fmt: str) -> None:
    p.add_argument("input", type=user_path, metavar="IN", help=f"raw input file ({fmt})")
    p.add_argument("output", type=user_path, metavar="OUT.parquet", help="parquet file to write (parent folders are created)")
    p.add_argument("--split", default="train", help="split name stored in extra_info.split (default: train)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT.parquet if it exists")


def _add_gsm8k(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "gsm8k",
        "convert GSM8K JSONL (question/answer) to parquet",
        "Convert GSM8K (one JSON object per line with 'question' and 'answer', as in the official "
        "release) to the verl schema.\n\n"
        "  prompt        one user message: the question + ' Let's think step by step and output the final\n"
        "                answer after \"####\".'\n"
        "  ground_truth  the text after the last '####' of the answer, commas removed ('1,234' -> '1234')\n"
        "  data_source   openai/gsm8k (the gsm8k reward function's key)\n"
        "  extra_info    split, index, question, answer\n\n"
        "With --tools, the tool-use variant for agent rollouts (configs/gsm8k_tool_agent.yaml, docs/agents.md):\n"
        "  prompt        a system message that offers the calculator tool (configs/tools/calculator.yaml,\n"
        "                rollout.agent.tools_file), then the bare question as the user message\n"
        "  agent_name    tool_agent\n\n"
        "An answer without '####', or whose final answer is no number ('18 dollars', '3/4': the gsm8k\n"
        "reward compares numbers and would score every response 0), is an error naming the line.",
    )
    _add_io(p, ".jsonl with question, answer")
    p.add_argument("--tools", action="store_true", help="write the tool-use variant (agent_name tool_agent, calculator)")
    p.set_defaults(handler=_guarded(_run_gsm8k))


def _add_math(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "math",
        "convert MATH-style JSONL (problem/solution with \\boxed{}) to parquet",
        "Convert MATH-style data (one JSON object per line with 'problem' and 'solution') to the verl "
        "schema.\n\n"
        "  prompt        one user message: the problem + ' Let's think step by step and output the final\n"
        "                answer within \\boxed{}.'\n"
        "  ground_truth  the content of the solution's last \\boxed{...} (nested braces kept)\n"
        "  data_source   math\n"
        "  extra_info    split, index, problem, solution\n\n"
        "A solution without a complete \\boxed{...}, or whose last box is empty, is an error naming the line.",
    )
    _add_io(p, ".jsonl with problem, solution")
    p.set_defaults(handler=_guarded(_run_math))


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "convert",
        "convert any JSONL/CSV to parquet by naming the prompt and answer fields",
        "Convert any JSONL (one object per line) or CSV (with a header row) to the verl schema.\n\n"
        "A string prompt becomes one user message (a string that is messages written out, as JSON or\n"
        "as pandas writes a list cell to CSV, is refused); a JSONL prompt that already is a list of {role,\n"
        "content} messages is kept: each role is system, user, assistant or tool and each content a\n"
        "string. Any other prompt (a number, an object) is refused. Either way, --system becomes a\n"
        "first system message (a row whose messages have a system message already is refused) and\n"
        "--suffix is appended to the last user message, after a space. Keys besides role and content\n"
        "(an assistant message's tool_calls, a tool message's name and tool_call_id) are kept for the\n"
        "chat template, a null value read as no key; one that the parquet file would give back\n"
        "changed (an object's keys in another order than in earlier rows, an int where they have a\n"
        "float, an object where they have text) is refused.\n\n"
        "The answer field becomes reward_model.ground_truth: a string, or a JSON number written as\n"
        "answers are: an integral value as an integer (3.0 -> \"3\"), any other in plain notation,\n"
        "all its digits kept, trailing zeros dropped (1.50 -> \"1.5\", 1e-5 -> \"0.00001\"); quote a\n"
        "number in the JSON to keep it as written. A bool, list, object or null is refused, and so\n"
        "is a number with more than 100 digits before or after the point written out (1e-999999).\n\n"
        "A bad record is one error line naming the line of the file, the field and, for messages,\n"
        "the message (numbered from 0) and its key.",
    )
    _add_io(p, ".jsonl or .csv")
    p.add_argument("--prompt-field", required=True, metavar="NAME", help="field holding the prompt")
    p.add_argument("--answer-field", required=True, metavar="NAME", help="field holding the ground-truth answer")
    p.add_argument("--data-source", required=True, metavar="NAME", help="data_source of every row (selects the reward function)")
    p.add_argument("--system", default="", metavar="TEXT",
                   help="system message put first in each prompt (a row with a system message of its own is refused)")
    p.add_argument("--suffix", default="", metavar="TEXT", help="instruction appended to each prompt's last user message after a space")
    p.add_argument("--ability", default="", metavar="TEXT", help="ability label of every row (default: empty)")
    p.set_defaults(handler=_guarded(_run_convert))


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "inspect",
        "check a prompt parquet file and print rows, columns, data sources and prompt lengths",
        "Read a prompt file with the same checks as training (a malformed row is an error naming\n"
        "row and column) and print: row count, columns and their types, rows per data_source, and\n"
        "prompt-length percentiles p50/p90/p99/max: in tokens after the chat template when\n"
        "--tokenizer is given, in characters of the prompt text otherwise.",
    )
    p.add_argument("file", type=user_path, metavar="FILE.parquet", help="the parquet file to inspect")
    p.add_argument("--tokenizer", type=user_path, metavar="HF_DIR", help="HF model or tokenizer directory: measure lengths in tokens")
    p.add_argument("--raw", action="store_true", help="with --tokenizer: measure raw prompt text, without the chat template")
    p.add_argument("--prompt-key", default="prompt", help="column holding the prompt (data.prompt_key; default: prompt)")
    p.add_argument("--max-prompt-length", type=int, metavar="N", help="with --tokenizer: also count prompts longer than N tokens")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=_guarded(_run_inspect))


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "demo",
        "write the CPU demo's task data (reverse digit strings) as train.parquet and val.parquet",
        "Write the synthetic task of the CPU demo: the prompt is a digit string ('472'), the\n"
        "ground truth its reverse ('274'), data_source reverse_digits. Every string of --digits\n"
        "digits appears exactly once: --val-size of them (chosen by --seed) go to val.parquet and\n"
        "never appear in train.parquet. Pair it with a tiny model built with task_vocab '0123456789'.",
    )
    p.add_argument("out_dir", type=user_path, metavar="OUT_DIR", help="folder to write train.parquet and val.parquet into")
    p.add_argument(
        "--digits", type=int, default=3,
        help="length of each digit string (default: 3, i.e. 1000 strings; the reverse_digits reward scores any length)",
    )
    p.add_argument("--val-size", type=int, default=200, help="strings held out for validation (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace train.parquet and val.parquet if they exist")
    p.set_defaults(handler=_guarded(_run_demo))


# ---- handlers --------------------------------------------------------------------------------
def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print a data error as one line and return EXIT_USER instead of a traceback."""

    def handler(args: argparse.Namespace) -> int:
        from megarl.data.datasets import DataError
        from megarl.terminal import EXIT_USER

        try:
            return run(args)
        except DataError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USER

    return handler


def _refuse_existing(paths: list[Path], overwrite: bool, fix: str) -> None:
    """A file the user already has is replaced only when asked (--overwrite); checked before any
    input is read, so a refusal costs nothing."""
    from megarl.commands.outputs import check_folder, check_new_file

    for path in paths:
        check_new_file(path, overwrite, flag="", fix=fix)
        check_folder(path, flag="")  # made when written (write_prompt_file)


def _check_output(args: argparse.Namespace) -> None:
    """A converter's OUT.parquet, checked before its input is read (a big JSONL takes a while)."""
    from megarl.data.datasets import DataError

    if Path(args.output).suffix != ".parquet":
        raise DataError(f"{args.output}: the output must be a .parquet file; give OUT.parquet")
    _refuse_existing([Path(args.output)], args.overwrite, "give another OUT.parquet")


def _report(rows: list, args: argparse.Namespace) -> int:
    from megarl.data.convert import write_rows

    path = write_rows(rows, args.output, args.input)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


def _run_gsm8k(args: argparse.Namespace) -> int:
    from megarl.data.convert import gsm8k_rows

    _check_output(args)
    return _report(gsm8k_rows(args.input, split=args.split, tools=args.tools), args)


def _run_math(args: argparse.Namespace) -> int:
    from megarl.data.convert import math_rows

    _check_output(args)
    return _report(math_rows(args.input, split=args.split), args)


def _run_convert(args: argparse.Namespace) -> int:
    from megarl.data.convert import generic_rows

    _check_output(args)
    rows = generic_rows(
        args.input,
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        data_source=args.data_source,
        system=args.system,
        suffix=args.suffix,
        ability=args.ability,
        split=args.split,
    )
    return _report(rows, args)


def _run_inspect(args: argparse.Namespace) -> int:
    from megarl.data.summary import format_summary, load_tokenizer, summarize_prompt_file

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    summary = summarize_prompt_file(
        args.file,
        tokenizer,
        prompt_key=args.prompt_key,
        apply_chat_template=not args.raw,
        max_prompt_length=args.max_prompt_length,
    )
    print(json.dumps(summary.to_dict(), indent=2, default=str) if args.json else format_summary(summary))
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from megarl.data.tasks import write_reverse_digits

    out = Path(args.out_dir)
    _refuse_existing([out / "train.parquet", out / "val.parquet"], args.overwrite, "give another OUT_DIR")
    train, val = write_reverse_digits(args.out_dir, num_digits=args.digits, val_size=args.val_size, seed=args.seed)
    print(f"wrote {train} and {val}")
    return 0
