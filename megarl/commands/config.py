"""`megarl config [SECTION | KEY]`: the configuration reference, read from the typed config models;
`megarl config --from-verl RUN --out FILE`: a verl run translated into a megarl config."""

from __future__ import annotations

import argparse

from megarl.commands.arguments import user_path

FROM_VERL_HELP = """translating a verl run:
  megarl config --from-verl run_qwen2-7b.sh --out megarl.yaml
  megarl config --from-verl ppo.yaml trainer.n_gpus_per_node=4 --out megarl.yaml

  RUN is a verl run script (the `python3 -m verl.trainer.main_ppo key=value ...` line, with its
  `export` and variable lines) or a verl YAML config; verl overrides after it win. verl's defaults
  apply to the keys not given. The table prints every verl key given, one per line, with the
  megarl key and value it became or why megarl has none; docs/migrating-from-verl.md has the
  whole mapping. The written config is checked by megarl plan.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print every config key with its default and meaning; translate a verl run (--from-verl)",
                       description="The configuration reference, read from megarl's typed config models; with --from-verl, "
                       "a verl run translated into a megarl config.",
                       epilog=FROM_VERL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("section", nargs="?", default=None, metavar="SECTION | KEY",
                   help="a section such as rollout or actor.optimizer, or one key such as actor.optimizer.lr (default: all)")
    p.add_argument("overrides", nargs="*", metavar="VERL_KEY=VALUE", help="with --from-verl: verl overrides, as on verl's command line")
    p.add_argument("--from-verl", type=user_path, default=None, metavar="RUN",
                   help="a verl run script (.sh) or verl YAML config to translate into a megarl config")
    p.add_argument("--out", type=user_path, default=None, metavar="FILE", help="with --from-verl: the megarl config to write")
    p.add_argument("--accept-differences", action="store_true",
                   help="with --from-verl: write the config even when a verl key megarl cannot carry (a LoRA adapter to "
                   "continue from, a critic's LoRA) makes the megarl run train differently")  # fmt: skip
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megarl.config.loading import ConfigError

    words = [args.section, *args.overrides] if args.section is not None else list(args.overrides)
    if args.from_verl is not None:
        from megarl.commands.from_verl import from_verl

        return from_verl(args.from_verl, words, args.out, accept_differences=args.accept_differences)
    if args.out is not None or len(words) > 1:
        raise ConfigError(f"megarl config takes one SECTION or KEY (got {' '.join(words) or '--out'}); --out and verl "
                          "overrides go with --from-verl RUN")  # fmt: skip
    from megarl.config.documentation import describe

    print(describe(args.section))
    return 0
