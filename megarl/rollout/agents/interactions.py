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

import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.rollout.agents.errors import AgentError
from megarl.rollout.agents.tools import import_class, read_yaml_list, run_method
from megarl.user_code import (
    DeadlinePassed,
    call_with_deadline,
    ends_process,
    exit_description,
    printed_head,
    source_file,
)


class InteractionFileError(AgentError):
    """An interaction file that cannot be used; the message names the file, the entry and the fix."""


class InteractionTimeout(AgentError):
    """A method of an interaction did not return within rollout.agent.interaction_timeout_s."""


_WHEN = {"start_interaction": "as each conversation starts", "finalize_interaction": "as each conversation ends"}


class Interaction:
    """A user's interaction object, called the same way whether its methods are async or not."""

    def __init__(self, name: str, impl: Any, timeout_s: float = 600.0):
        """``timeout_s``: rollout.agent.interaction_timeout_s, the time one call of a method may take."""
        self.name, self.impl, self.timeout_s = name, impl, timeout_s

    def session(self, kwargs: Mapping[str, Any]) -> InteractionSession:
        """One trajectory's conversation (verl's start_interaction)."""
        instance_id = uuid.uuid4().hex
        started = self.call("start_interaction", lambda: self.impl.start_interaction(instance_id, **_without_name(kwargs)))
        return InteractionSession(self, str(started or instance_id), _without_name(kwargs))

    def call(self, method: str, invoke: Callable[[], Any]) -> Any:
        """The value of ``invoke()``, a call of the user's ``method`` (plain or async); AgentError
        naming the method when it raises."""
        where = f"interaction {self.name!r} ({type(self.impl).__name__}.{method} in {source_file(self.impl)})"
        try:
            # in a thread with a deadline, as a tool call: a method that never returns would hang the run
            return call_with_deadline(lambda: run_method(invoke()), self.timeout_s, where)
        except DeadlinePassed:
            when = _WHEN.get(method, "between the model's turns")
            raise InteractionTimeout(f"{where} did not return within {self.timeout_s:g} s; make it return sooner (it "
                                     f"runs {when}: a rule check, not a long call) or raise "
                                     f"rollout.agent.interaction_timeout_s{printed_head(where)}") from None
        except Exception as exc:  # the user's code: name it (the run stops; a simulated user has no fallback)
            raise AgentError(f"{where} raised {type(exc).__name__}: {exc}; fix it{printed_head(where)}") from exc
        except BaseException as exc:
            if not ends_process(exc):  # the user's own Ctrl-C
                raise
            raise AgentError(f"{where} {exit_description(exc)}; an interaction must return its answer or raise, never "
                             f"end the process{printed_head(where)}") from exc


@dataclass(frozen=True)
class Reply:
    done: bool  # the conversation is over (verl's should_terminate_sequence)
    text: str
    score: float


class InteractionSession:
    """One trajectory's conversation with its interaction: respond between turns, finish at the end."""

    def __init__(self, interaction: Interaction, instance_id: str, kwargs: dict[str, Any]):
        self.interaction, self.instance_id, self.kwargs = interaction, instance_id, kwargs
        self.hung = False  # generate_response passed its deadline

    def respond(self, messages: list[dict[str, str]]) -> Reply:
        impl = self.interaction.impl
        where = f"interaction {self.interaction.name!r} ({type(impl).__name__}.generate_response)"
        try:
            answer = self.interaction.call("generate_response", lambda: impl.generate_response(self.instance_id, messages, **self.kwargs))
        except InteractionTimeout:
            self.hung = True  # its finalize_interaction would wait on the hung call's state: the run stops now
            raise
        try:
            done, text, score, *_ = answer
            reply = Reply(bool(done), str(text), float(score or 0.0))
        except (TypeError, ValueError):
            raise AgentError(f"{where} returned {answer!r:.80}; return (should_terminate: bool, response: str, "
                             "score: float, extra: dict) as verl's BaseInteraction does") from None
        if not math.isfinite(reply.score):  # the score is a reward (turn_rewards): it would reach the loss as it is
            raise AgentError(f"{where} returned the score {reply.score}; return a finite number")
        return reply

    def finish(self) -> None:
        """verl's finalize_interaction, when the class has one."""
        impl = self.interaction.impl
        if not self.hung and getattr(impl, "finalize_interaction", None) is not None:
            self.interaction.call("finalize_interaction", lambda: impl.finalize_interaction(self.instance_id))


def open_session(interactions: Mapping[str, Interaction], kwargs: Mapping[str, Any]) -> InteractionSession:
    """The conversation ``extra_info.interaction_kwargs`` asks for."""
    return interactions[interaction_name(kwargs, list(interactions))].session(kwargs)


def interaction_name(kwargs: Mapping[str, Any], names: list[str]) -> str:
    """Which interaction ``extra_info.interaction_kwargs`` asks for: its ``name``, or the only one
    of the file when it names none; AgentError naming the problem and the fix otherwise."""
    name = kwargs.get("name")
    if name is None and len(names) == 1:
        return names[0]
    if name is None:
        raise AgentError(f"extra_info.interaction_kwargs has no name and rollout.agent.interactions_file has "
                         f"{len(names)} interactions ({', '.join(names) or 'none'}); add name to interaction_kwargs")  # fmt: skip
    if name not in names:
        raise AgentError(f"extra_info.interaction_kwargs.name {name!r} is not in rollout.agent.interactions_file "
                         f"(it has {', '.join(names) or 'none'})")  # fmt: skip
    return str(name)


def read_interaction_names(path: str | Path) -> list[str]:
    """The names an interaction file defines, without importing any class."""
    entries = read_yaml_list(path, "interaction", "interaction file", InteractionFileError)
    return [_entry_name(entry, f"interaction file {path}, interaction[{i}]") for i, entry in enumerate(entries)]


def _entry_name(entry: Any, where: str) -> str:
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise InteractionFileError(f"{where}: needs class_name (got {entry!r})")
    return str(entry.get("name") or str(entry["class_name"]).replace(":", ".").rsplit(".", 1)[-1].removesuffix("Interaction").lower())


def _without_name(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs the class gets: all but ``name``, and no nulls (in a parquet struct a null is a
    key this row did not have, so the class's own default applies)."""
    from megarl.data.datasets import without_nulls

    return without_nulls({k: v for k, v in kwargs.items() if k != "name"})


def load_interactions(path: str | Path, timeout_s: float = 600.0,
                      building: Callable[[str], None] | None = None) -> dict[str, Interaction]:
    """The interactions of a verl-format interaction file, by name; ``timeout_s``: rollout.agent.interaction_timeout_s;
    ``building``: told what is built next, once its class is imported (as load_tools's)."""
    label = f"interaction file {path}"
    out: dict[str, Interaction] = {}
    for i, entry in enumerate(read_yaml_list(path, "interaction", "interaction file", InteractionFileError)):
        where = f"{label}, interaction[{i}]"
        name = _entry_name(entry, where)
        cls = import_class(str(entry["class_name"]), where, InteractionFileError)
        if name in out:
            raise InteractionFileError(f"{where}: a second interaction named {name!r}; names must be unique")
        config = {**dict(entry.get("config") or {}), "name": name}
        if building is not None:
            building(f"building {entry['class_name']} ({where})")
        try:
            out[name] = Interaction(name, cls(config=config), timeout_s)
        except Exception as exc:  # noqa: BLE001 - the user's class: name it and its error
            raise InteractionFileError(f"{where}: {entry['class_name']}(config={config}) failed: {type(exc).__name__}: {exc}") from exc
        except BaseException as exc:  # sys.exit in __init__: the class named (the user's Ctrl-C passes)
            if not ends_process(exc):
                raise
            raise InteractionFileError(f"{where}: {entry['class_name']}(config={config}) {exit_description(exc)} while it was "
                                       "built; an interaction must raise an exception, never end the process") from exc
    return out
