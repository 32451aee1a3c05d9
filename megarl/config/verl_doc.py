"""The verl -> megarl tables of docs/migrating-from-verl.md (and docs/agents.md's multi-turn one),
written from the mapping `megarl config --from-verl` uses (megarl/config/verl_keys.py): a test
fails when a page's generated part and the mapping differ. ``python -m megarl.config.verl_doc``
rewrites the pages' generated parts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.config.verl_keys import NONE, RULES, Rule

BEGIN = "<!-- generated from megarl/config/verl_keys.py by `python -m megarl.config.verl_doc`: do not edit -->"
END = "<!-- end of the generated part -->"

# verl's config groups, most specific first, each with the megarl sections it becomes.
GROUPS = (
    ("data", "`data`", "data, rollout.sampling"),
    ("actor_rollout_ref.model", "`actor_rollout_ref.model`", "model, actor.lora, actor"),
    ("actor_rollout_ref.actor.megatron", "`actor_rollout_ref.actor.megatron`", "actor.parallel, actor.offload"),
    ("actor_rollout_ref.actor.optim", "`actor_rollout_ref.actor.optim`", "actor.optimizer"),
    ("actor_rollout_ref.actor", "`actor_rollout_ref.actor`", "actor, algorithm"),
    ("actor_rollout_ref.ref", "`actor_rollout_ref.ref`", "reference"),
    ("actor_rollout_ref.rollout.multi_turn", "`actor_rollout_ref.rollout.multi_turn`, `.agent`", "rollout.agent"),
    ("actor_rollout_ref.rollout", "`actor_rollout_ref.rollout`", "rollout"),
    ("actor_rollout_ref", "`actor_rollout_ref` (itself)", "cluster"),
    ("critic", "`critic`", "critic, algorithm.clip"),
    ("reward_model", "`reward_model`, `custom_reward_function`", "reward, algorithm.overlong"),
    ("algorithm", "`algorithm`", "algorithm"),
    ("trainer", "`trainer`", "trainer, cluster"),
    ("", "everything else (profilers, Ray, FSDP and Megatron internals)", "-"),
)
MULTI_TURN = ("actor_rollout_ref.rollout.multi_turn", "actor_rollout_ref.rollout.agent")


def _group_of(rule: Rule) -> str:
    key = rule.verl
    if key.startswith("custom_reward_function"):
        return "reward_model"
    if key.startswith(f"{MULTI_TURN[1]}."):
        return MULTI_TURN[0]
    return next(prefix for prefix, _, _ in GROUPS if not prefix or key.startswith(f"{prefix}."))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(rule: Rule) -> str:
    megarl = ", ".join(f"`{k}`" for k in rule.megarl) if rule.megarl else f"none ({rule.group})" if rule.group != NONE else "none"
    default = f"`{rule.doc_default}`" if rule.doc_default and not callable(rule.default) else _cell(rule.doc_default)
    return f"| `{rule.verl}` | {default} | {megarl} | {_cell(rule.reason)} |"


def overview() -> str:
    """verl's groups side by side with megarl's sections, and how many keys each maps."""
    lines = ["| verl group | megarl sections | verl keys | with a megarl key |", "|---|---|---|---|"]
    for prefix, title, sections in GROUPS:
        rules = [r for r in RULES if _group_of(r) == prefix]
        sections_text = ", ".join(f"`{s}`" for s in sections.split(", ")) if sections != "-" else "-"
        lines.append(f"| {title} | {sections_text} | {len(rules)} | {sum(bool(r.megarl) for r in rules)} |")
    return "\n".join(lines)


def key_tables(prefixes: tuple[str, ...] | None = None) -> str:
    """One table per verl group: each rule's verl key (``*`` spans any parts), verl's default,
    the megarl keys, and the note or the reason there is none."""
    parts: list[str] = []
    for prefix, title, _ in GROUPS:
        if prefixes is not None and prefix not in prefixes:
            continue
        rules = [r for r in RULES if _group_of(r) == prefix]
        parts += [f"#### {title}", "", "| verl key | verl default applied | megarl | note |", "|---|---|---|---|"]
        parts += [_row(r) for r in rules] + [""]
    return "\n".join(parts).rstrip("\n")


def migration_part() -> str:
    return f"{overview()}\n\n{key_tables()}"


def agents_part() -> str:
    return key_tables((MULTI_TURN[0],)).split("\n", 2)[2]  # the table without its heading


PAGES = {"migrating-from-verl.md": migration_part, "agents.md": agents_part}


def generated(text: str) -> str:
    """The generated part of a page's text ('' when it has none)."""
    if BEGIN not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def rewrite(docs: Path) -> None:
    for name, make in PAGES.items():
        page = docs / name
        text = page.read_text()
        head, rest = text.split(BEGIN, 1)
        page.write_text(f"{head}{BEGIN}\n{make()}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    rewrite(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs"))
