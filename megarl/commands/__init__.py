"""The command-line commands: each module registers its subcommand with the main parser
(megarl/cli.py) and holds the orchestration behind it."""
