"""Every function and method under ``src/mmtune/data`` and ``src/mmtune/training`` reads in one screen.

The length counts from the ``def`` line (decorators excluded) through the last
line of the body, docstring included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MAX_LINES = 80
SRC = Path(__file__).resolve().parents[1] / "src" / "mmtune"
CHECKED_PACKAGES = ("data", "training")


def long_functions(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """Return ``("path:line name", length)`` for each function over ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    where = f"{path.relative_to(root)}:{node.lineno} {node.name}"
                    found.append((where, length))
    return found


def test_long_functions_counts_def_through_last_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    (tmp_path / "fits.py").write_text(f"def fits():\n{body}\n")
    (tmp_path / "over.py").write_text(f"@staticmethod\ndef over():\n{body}\n    return 0\n")
    assert long_functions(tmp_path) == [("over.py:2 over", MAX_LINES + 1)]


@pytest.mark.parametrize("package", CHECKED_PACKAGES)
def test_no_function_over_limit(package):
    offenders = long_functions(SRC / package)
    listing = "\n".join(f"  {where}: {n} lines" for where, n in offenders)
    assert not offenders, (
        f"functions over {MAX_LINES} lines under src/mmtune/{package} (split them into "
        f"named helpers):\n{listing}"
    )
