"""A small name -> function registry for the algorithm modules.

Each kind of algorithm (advantage estimators, policy losses, KL estimators) keeps one
``Registry``; the config validates names without importing torch (megarl/config/sections.py
lists them) and a unit test keeps both lists equal. A lookup miss names the kind, the bad
name and every valid one.

Users extend a registry by import path: a name of the form ``package.module:function`` is
imported on first use (in every process that looks it up, so the module must be importable
there: installed, or on PYTHONPATH) and must be callable; see docs/extending.md. Deliberately
no plugin discovery or entry points.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from megarl.config.section_base import IMPORT_PATH

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
        if name in self._fns:
            return self._fns[name]
        if is_import_path(name):
            return load_import_path(name, self.kind)  # type: ignore[return-value]
        valid = ", ".join(self._fns)
        raise UnknownNameError(
            f"unknown {self.kind} {name!r}; valid names: {valid}, or your own function as package.module:function"
        )

    __getitem__ = get

    def names(self) -> tuple[str, ...]:
        return tuple(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)


def is_import_path(name: str) -> bool:
    """``package.module:function`` (what a user's own function is named by)."""
    return bool(IMPORT_PATH.match(name))


def load_import_path(path: str, kind: str, what: str = "function") -> Callable[..., object]:
    """Import ``package.module:function`` (``what``: the thing the fix asks for, e.g. "class")
    and return it; a missing module, a missing attribute or something that is not callable is
    an error naming the path and the fix."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnknownNameError(
            f"{kind} {path!r}: cannot import {module_name} ({err}); install it or put its folder on PYTHONPATH "
            "(every process that runs it needs it)"
        ) from None
    except Exception as err:  # the user's module itself fails while importing (a syntax error, ...)
        raise UnknownNameError(f"{kind} {path!r}: importing {module_name} failed: {type(err).__name__}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = "has no attribute" if fn is None else "has a non-callable"
        raise UnknownNameError(f"{kind} {path!r}: module {module_name} {found} {attr!r}; name a {what}")
    return fn
