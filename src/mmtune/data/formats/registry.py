"""Name -> data format: what the readers, the config checks and ``mmtune data check`` ask.

A format registers itself with :func:`register_format` when its module is imported. The
built-in formats are the modules of this package, found and imported on first use, so
there is no list to keep.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmtune.core.plugins import import_package_modules

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.formats.base import DataFormat

__all__ = ["register_format", "format_names", "get_format", "detect_format"]

_REGISTRY: dict[str, "DataFormat"] = {}


def register_format(cls: type["DataFormat"]) -> type["DataFormat"]:
    """Class decorator: make the format ``cls`` available under ``cls.name``.

    Raises:
        ValueError: ``cls`` has no name or no ``keys``, or another class already holds the name.
    """
    problems = []
    if not cls.name:
        problems.append("set the class attribute `name` (SourceConfig.format and --format use it)")
    if not cls.keys:
        problems.append("set `keys`: what its records hold, for the message when no format fits a file")
    if problems:
        raise ValueError(f"data format class {cls.__module__}.{cls.__qualname__}: " + "; ".join(problems))
    other = _REGISTRY.get(cls.name)
    if other is not None and type(other) is not cls:
        raise ValueError(f"data format {cls.name!r} is registered twice ({type(other).__module__}."
                         f"{type(other).__qualname__} and {cls.__module__}.{cls.__qualname__}); rename one")
    _REGISTRY[cls.name] = cls()
    return cls


def _discover() -> None:
    """Import every module of this package once; the format modules register themselves."""
    import_package_modules(__package__, str(Path(__file__).parent))


def format_names() -> tuple[str, ...]:
    """Every registered format, built-in ones first (in module order), then the others."""
    _discover()
    return tuple(_REGISTRY)


def get_format(name: str) -> "DataFormat":
    """The format registered as ``name``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    _discover()
    if name not in _REGISTRY:
        raise ValueError(f"format={name!r} is unknown: use one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def _keys(obj: Any) -> str:
    return str(sorted(map(str, obj))[:12]) if isinstance(obj, dict) else f"a {type(obj).__name__}, not an object"


def detect_format(path: str, *, sample: int = 50, max_record_bytes: int | None = None) -> tuple[str, str]:
    """``(format, why)`` of a data file, from its first ``sample`` records: the registered
    format whose :meth:`~mmtune.data.formats.base.DataFormat.detect` scores them highest.
    No record is read past ``max_record_bytes`` (default: ``data.validation.max_record_bytes``'s).

    Raises:
        ValueError: no record looks like any format; the message says which keys each
            format needs and which the first record has.
        DataValidationError: a JSON list broken in its own structure.
    """
    from mmtune.data.records import MAX_RECORD_BYTES, iter_records
    from mmtune.data.tables import EmbeddedImages, is_table_input, iter_table_records

    records: list[dict] = []
    first: Any = None
    limit = max_record_bytes or MAX_RECORD_BYTES
    rows = (iter_table_records(path, EmbeddedImages("embedded", write=False), limit) if is_table_input(path)
            else iter_records(path, limit))
    for _, obj, problem in rows:
        if first is None and problem is None:
            first = obj
        if problem is None and isinstance(obj, dict):
            records.append(obj)
        if len(records) >= sample:
            break
    names = format_names()
    expected = "; ".join(f"{fmt.keys} ({name})" for name, fmt in _REGISTRY.items())
    choose = f"pass --format {{{','.join(names)}}}"
    if not records:
        found = "no readable record" if first is None else f"the first record is {_keys(first)}"
        raise ValueError(f"{path}: no JSON object records found ({found}); write one of: {expected}; or {choose}")
    found = [(fmt.detect(records), n) for n, fmt in enumerate(_REGISTRY.values())]
    best, order = max(found, key=lambda item: (item[0].score, -item[1]))
    if best.score > 0:
        return names[order], best.why
    hints = list(dict.fromkeys(d.why for d, _ in found if d.why))
    if hints:
        raise ValueError(f"{path}: " + "; ".join(hints) + f"; or {choose}")
    raise ValueError(f"{path}: cannot tell the format: expected one of: {expected}; the first record has keys "
                     f"{_keys(records[0])}. Rename the keys, or {choose}")
