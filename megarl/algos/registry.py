"""A small name -> function registry for the algorithm modules.

Each kind of algorithm (advantage estimators, policy losses, KL estimators) keeps one
``Registry``; the config validates names without importing torch (megarl/config/sections.py
lists them) and a unit test keeps both lists equal. A lookup miss names the kind, the bad
name and every valid one. Deliberately no plugin discovery or entry points: registering is an
import-time decorator call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class UnknownNameError(KeyError):
    """Lookup of a name no function was registered under."""

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0])


class Registry(Generic[F]):
    """Functions of one kind, by name (insertion-ordered)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # e.g. "advantage estimator", used in error messages
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("grpo")``; a second function under one name is an error."""

        def add(fn: F) -> F:
            if name in self._fns:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({self._fns[name]!r})"
                )
            self._fns[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        try:
            return self._fns[name]
        except KeyError:
            valid = ", ".join(self._fns)
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    __getitem__ = get

    def names(self) -> tuple[str, ...]:
        return tuple(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)
