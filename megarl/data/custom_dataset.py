"""A user's own dataset class (``data.custom_cls``, verl's): prompts from any source.

The class is verl's custom dataset contract, as megarl reads it::

    class MyDataset:                                  # torch.utils.data.Dataset or a plain class
        def __init__(self, data_files, tokenizer, config, processor=None): ...
        def __len__(self) -> int: ...
        def __getitem__(self, i) -> dict: ...         # one row in the verl schema

- ``data_files``: the paths of data.train_files (a training dataset) or data.val_files (the
  validation one), as a list of strings; ``tokenizer``: model.path's tokenizer; ``config``: the
  ``data`` section as a dict whose keys also read as attributes (``config.max_prompt_length``,
  ``config.get("prompt_key")``, as verl's DictConfig); ``processor`` (None) only when the
  ``__init__`` takes it.
- Each row (``__getitem__(i)`` for i in range(len)) is a dict with the verl schema's keys:
  the data source (data.reward_fn_key, ``data_source`` by default), the prompt (data.prompt_key,
  else ``raw_prompt``, which verl's RLHFDataset returns: text or chat messages),
  ``reward_model`` ({ground_truth, ...}), and optionally ``extra_info``, ``ability`` and
  ``agent_name``. Other keys (verl's input_ids, attention_mask, ...) are ignored: megarl templates
  and tokenizes the prompt itself (data.apply_chat_template, data.max_prompt_length).

Every row is read once when the run starts and checked as a parquet row is; a bad row is a
DataError naming the class and the row. The class is checked before launch in a child process
(:func:`class_problem`: the file imports, the name is a class with ``__len__`` and
``__getitem__`` whose ``__init__`` takes those arguments; then :func:`first_rows_problem`: it is
built on data.train_files and its first rows read and checked), so an error in the user's
building or reading code is one line before Ray starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ARGUMENTS = ("data_files", "tokenizer", "config")


class DataConfigView(dict):
    """The data section for a user's class: a dict whose keys also read as attributes (as verl's
    DictConfig: ``config.prompt_key``, ``config.get("max_prompt_length")``)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def load_class(path: str, name: str) -> type:
    """Import ``path`` and return its class ``name``, checked to fit (:func:`fit_problem`);
    ValueError as one line naming data.custom_cls otherwise. The module's own import errors
    propagate with their traceback."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"data.custom_cls.path: {path} is not a file; give the path of the Python file that defines "
                         "your dataset class")
    module_name = "megarl_dataset_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    cls = getattr(sys.modules[module_name], name, None)
    if cls is None:
        classes = sorted(k for k, v in vars(sys.modules[module_name]).items() if inspect.isclass(v) and not k.startswith("_"))
        raise ValueError(f"data.custom_cls.name: {name!r} is not defined in {path}; classes there: {', '.join(classes) or 'none'}")
    problem = fit_problem(cls)
    if problem:
        raise ValueError(f"data.custom_cls: {name} ({path}) {problem}")
    return cls


def fit_problem(cls: Any) -> str | None:
    """Why ``cls`` cannot serve as a dataset class, as the rest of a sentence, or None."""
    if not inspect.isclass(cls):
        return f"is a {type(cls).__name__}, not a class"
    missing = [m for m in ("__len__", "__getitem__") if not callable(getattr(cls, m, None))]
    if missing:
        return f"has no {' and no '.join(missing)}; a dataset class gives its row count and row i as a dict"
    try:
        inspect.signature(cls).bind(**dict.fromkeys(ARGUMENTS))
    except TypeError as exc:
        return (f"cannot be built as {cls.__name__}(data_files=..., tokenizer=..., config=...) ({exc}); its __init__ "
                "takes verl's arguments: data_files, tokenizer, config (and processor=None, optional)")
    except ValueError:  # no signature to read (a class in C): it is built as it is
        return None
    return None


def class_problem(path: str, name: str) -> str | None:
    """:func:`load_class` as the pre-launch check runs it: why the class does not load or fit, or None."""
    try:
        load_class(path, name)
    except ValueError as exc:
        return str(exc)
    return None


ROWS_CHECKED = 2  # read before launch: enough to meet an error of the reading code, cheap for any dataset


def first_rows_problem(path: str, name: str, build: dict[str, Any], step: Callable[[str], None] | None = None) -> str | None:
    """The class built as a run builds it and its first ROWS_CHECKED rows read and checked, as the
    pre-launch check runs it (in its child process): why that fails, as one line, or None. ``build``:
    ``files`` and their ``field`` (data.train_files), the tokenizer's ``model`` directory, the data
    section as ``config``. A model directory without a tokenizer is the model check's finding: no build.
    ``step(what)`` is told each call into the class before it runs (:func:`step_name`'s words): a
    process that ends in one (os._exit, a crash in C) is named by the one it had started."""
    from megarl.data.datasets import record_of_row
    from megarl.data.summary import load_tokenizer

    try:
        tokenizer = load_tokenizer(build["model"]) if build.get("model") else None
    except ValueError:
        return None
    label = f"data.custom_cls: {name} ({path}) on {build['field']}"
    step = step or (lambda what: None)
    try:
        cls = load_class(path, name)
        step(step_name(name, "__init__"))
        dataset = build_dataset(cls, build["files"], tokenizer, build["config"])
        step(step_name(name, "__len__"))
        rows = []
        for i in range(min(len(dataset), ROWS_CHECKED)):
            step(step_name(name, f"__getitem__({i})"))
            rows.append(dataset[i])
    except Exception as exc:  # the user's own code: the same words as the run's (megarl/data/stream.py)
        return f"{label}: building it or reading its first rows failed: {type(exc).__name__}: {exc}"
    if not rows:
        return None  # the run's own check names an empty dataset with the rest of the data
    try:
        for i, row in enumerate(rows):
            record_of_row(label, i, row, prompt_key=build["config"]["prompt_key"], source_key=build["config"]["reward_fn_key"])
    except ValueError as exc:
        return str(exc)
    return None


def step_name(name: str, hook: str) -> str:
    """What the pre-launch check says it runs of the class: its ``hook`` (``__init__``, ``__len__``,
    ``__getitem__(i)``) last, in parentheses, for :func:`step_hook`."""
    return f"building data.custom_cls {name} (its {hook})" if hook == "__init__" else f"reading data.custom_cls {name} (its {hook})"


def step_hook(what: str) -> str | None:
    """The hook a :func:`step_name` names (``__getitem__(0)``), or None for another step."""
    found = re.fullmatch(r"(?:building|reading) data\.custom_cls .* \(its (__\w+__(?:\(\d+\))?)\)", what)
    return found.group(1) if found else None


def build_dataset(cls: type, files: list[str], tokenizer: Any, config: dict[str, Any]) -> Any:
    """``cls`` built as verl builds it (processor=None when its __init__ takes one)."""
    kwargs: dict[str, Any] = {"data_files": list(files), "tokenizer": tokenizer, "config": DataConfigView(config)}
    try:
        params = inspect.signature(cls).parameters
    except ValueError:
        params = {}  # type: ignore[assignment]
    if "processor" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs["processor"] = None
    return cls(**kwargs)
