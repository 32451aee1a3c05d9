"""Interactions: a simulated user who answers the model between turns (verl's format).

An interaction file lists the classes by name::

    interaction:
      - name: gsm8k                                   # extra_info.interaction_kwargs.name picks it
        class_name: my_package.interactions.Gsm8kInteraction
        config: {}

The class follows verl's ``BaseInteraction``: ``__init__(config)``, ``start_interaction(
instance_id, **interaction_kwargs) -> instance_id``, ``generate_response(instance_id, messages,
**interaction_kwargs) -> (should_terminate, response, score, extra)`` and
``finalize_interaction(instance_id)``; each may be ``async``. It runs in the controller, inside
the rollout's driver: keep ``generate_response`` quick (a rule check, not a model call).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megarl.agents.tools import import_class, read_yaml_list, run_method


class InteractionFileError(ValueError):
    """An interaction file that cannot be used; the message names the file, the entry and the fix."""


class Interaction:
    """A user's interaction object, called the same way whether its methods are async or not."""

    def __init__(self, name: str, impl: Any):
        self.name, self.impl = name, impl

    def start(self, instance_id: str, kwargs: Mapping[str, Any]) -> str:
        started = run_method(self.impl.start_interaction(instance_id, **_without_name(kwargs)))
        return str(started or instance_id)

    def respond(self, instance_id: str, messages: list[dict[str, str]], kwargs: Mapping[str, Any]) -> tuple[bool, str, float]:
        done, text, score, *_ = run_method(self.impl.generate_response(instance_id, messages, **_without_name(kwargs)))
        return bool(done), str(text), float(score or 0.0)

    def finish(self, instance_id: str) -> None:
        """verl's finalize_interaction, when the class has one."""
        finalize = getattr(self.impl, "finalize_interaction", None)
        if finalize is not None:
            run_method(finalize(instance_id))


def _without_name(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "name"}


def load_interactions(path: str | Path) -> dict[str, Interaction]:
    """The interactions of a verl-format interaction file, by name."""
    label = f"interaction file {path}"
    out: dict[str, Interaction] = {}
    for i, entry in enumerate(read_yaml_list(path, "interaction", "interaction file", InteractionFileError)):
        where = f"{label}, interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise InteractionFileError(f"{where}: needs class_name (got {entry!r})")
        cls = import_class(str(entry["class_name"]), where, InteractionFileError)
        name = str(entry.get("name") or cls.__name__.removesuffix("Interaction").lower())
        if name in out:
            raise InteractionFileError(f"{where}: a second interaction named {name!r}; names must be unique")
        config = {**dict(entry.get("config") or {}), "name": name}
        try:
            out[name] = Interaction(name, cls(config=config))
        except Exception as exc:  # noqa: BLE001 - the user's class: name it and its error
            raise InteractionFileError(f"{where}: {entry['class_name']}(config={config}) failed: {type(exc).__name__}: {exc}") from exc
    return out
