"""Schema introspection: keys a composed config has that its typed schema does not (the
``+key`` typo catcher), the docstrings of a schema's fields (command-line help), and a
config's dotted keys (:func:`flatten_config`, :func:`key_covers`: what the config checks
and the resume check name).

OmegaConf rejects an unknown key while merging a YAML file into a structured config, but
Hydra's ``+key=value`` (which Hydra itself suggests when a key is missing) adds a key
with struct mode lifted, and the merge into the schema then keeps it silently: a
``+training.lerning_rate=1e-4`` run trains with the default rate. :func:`unknown_keys`
walks the composed config against the schema's dataclasses and lists every key the
schema does not define, with the closest known name; free-form ``dict`` fields (model
architecture overrides, judge prices) accept any key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

__all__ = ["unknown_keys", "field_docs", "flatten_config", "key_covers", "model_path_problem"]


def _unwrap(annotation: Any) -> Any:
    """``Optional[X]`` -> ``X``."""
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _schema_of(field: dataclasses.Field, annotated: type) -> type:
    """The class a dataclass field's value really has: its default's when that is a dataclass
    instance (``EvalConfig()`` builds the class with the registered benchmarks' sections),
    else the annotated class. OmegaConf reads a structured field's keys the same way."""
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = field.default
    return type(default) if dataclasses.is_dataclass(default) and not isinstance(default, type) else annotated


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """``["training.lerning_rate (did you mean training.lr?)", ...]`` for ``node`` (a
    DictConfig or plain dict) checked against the dataclass ``schema``."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if not isinstance(node, dict) or not dataclasses.is_dataclass(schema):
        return []
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems = []
    for key, value in node.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else f" (known: {', '.join(sorted(fields))})"
            problems.append(f"{name}{hint}")
            continue
        kind = _unwrap(hints.get(key))
        if dataclasses.is_dataclass(kind):
            kind = _schema_of(fields[key], kind)
            problems += unknown_keys(value, kind, f"{name}.")
        elif typing.get_origin(kind) in (list, typing.List) and isinstance(value, list):
            (item,) = typing.get_args(kind) or (None,)
            item = _unwrap(item)
            if dataclasses.is_dataclass(item):
                for i, element in enumerate(value):
                    problems += unknown_keys(element, item, f"{name}[{i}].")
    return problems


def _where(schema: type) -> str:
    """``mmtune.training.config.TrainingConfig (src/mmtune/training/config.py)``: a schema
    class and, when it lies under the current folder, its source file."""
    import inspect
    import os

    name = f"{schema.__module__}.{schema.__qualname__}"
    try:
        source = os.path.relpath(inspect.getsourcefile(schema) or "")
    except (TypeError, ValueError):  # built at run time, or on another drive
        return name
    return name if source.startswith("..") else f"{name} ({source})"


def _leaves(schema: type, prefix: str = "") -> dict[str, str]:
    """``{dotted key: leaf name}`` of every field of ``schema`` and its nested sections."""
    out = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = _unwrap(hints.get(f.name))
        if dataclasses.is_dataclass(kind):
            out.update(_leaves(_schema_of(f, kind), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = f.name
    return out


def describe_unknown_key(schema: type, key: str) -> str:
    """One line for a dotted ``key`` that ``schema`` does not have: the first part that is
    not a field, the closest known key (a field at that level, else a field of the same
    name elsewhere: ``lr`` -> ``training.lr``), and the schema class listing the keys.

    Example: ``unknown config key 'training.lerning_rat' (closest: training.learning_rate);
    the keys under training are the fields of mmtune.training.config.TrainingConfig``.
    """
    parts = key.split(".")
    cls, prefix = schema, []
    for part in parts:
        if not dataclasses.is_dataclass(cls):
            return (f"{'.'.join(prefix)} is a single value, not a section: {key!r} names nothing in it "
                    f"(its type is set by {_where(schema)})")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            bad = ".".join(prefix + [part])
            close = difflib.get_close_matches(part, sorted(fields), n=1)
            if close:
                suggestion = ".".join(prefix + close)
            else:  # the leaf may exist under another section
                leaves = _leaves(schema)
                same = [k for k, leaf in leaves.items() if leaf == parts[-1]]
                near = difflib.get_close_matches(parts[-1], sorted(set(leaves.values())), n=1)
                suggestion = same[0] if same else next((k for k, leaf in leaves.items() if near and leaf == near[0]), None)
            hint = f" (closest: {suggestion})" if suggestion else ""
            level = f"under {'.'.join(prefix)}" if prefix else "at the top level"
            return f"unknown config key {bad!r}{hint}; the keys {level} are the fields of {_where(cls)}"
        kind = _unwrap(typing.get_type_hints(cls).get(part))
        cls = _schema_of(fields[part], kind) if dataclasses.is_dataclass(kind) else kind
        prefix.append(part)
    return f"config key {key!r} cannot be set this way (its type is set by {_where(schema)})"


def field_docs(schema: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields carry docstrings (the string
    literal below each field, as every config schema here writes them), read from the
    source of the class and its dataclass bases; a field without one is left out."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for cls in reversed([c for c in schema.__mro__ if dataclasses.is_dataclass(c)]):
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):  # built at run time (no source): its bases still count
            continue
        body = ast.parse(source).body[0].body
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def model_path_problem(path: str | None, key: str = "model.path") -> str | None:
    """A message naming ``key`` when ``path`` is meant as a local directory and is not one.

    A path counts as local when it is absolute, starts with ``.`` or ``~``, or has more
    than one ``/``; ``org/name`` may be a hub id and is left to the loader.
    """
    import os

    if not path:
        return None
    local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.sep in path and path.count(os.sep) > 1
    expanded = os.path.expanduser(path)
    if local and not os.path.exists(expanded):
        return (f"{key}={path!r} does not exist: point it at a local checkpoint directory (config.json + weights) "
                "or a hub id such as llava-hf/llava-1.5-7b-hf")
    if os.path.exists(expanded) and not os.path.isdir(expanded):
        return f"{key}={path!r} is a file, not a checkpoint directory"
    return None


def flatten_config(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested config dict: ``{"training.lr": 2e-5, "data.mixture.sources[0].path": ...}``.

    Lists of objects are indexed (``[0]``); lists of plain values are one value.
    """
    if isinstance(value, dict):
        if not value and prefix:
            return {prefix: {}}
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten_config(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        flat = {}
        for i, item in enumerate(value):
            flat.update(flatten_config(item, f"{prefix}[{i}]"))
        return flat
    return {prefix: value}


def key_covers(entry: str, key: str) -> bool:
    """Whether config key ``entry`` is ``key`` or one of its parents (``training`` covers ``training.lr``)."""
    return key == entry or key.startswith(entry + ".") or key.startswith(entry + "[")
