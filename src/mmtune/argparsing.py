"""Command-line parsing shared by the ``mmtune`` commands: a typo names the closest flag,
and help text taken from docstrings reads as plain text.

:class:`ArgumentParser` is ``argparse.ArgumentParser`` whose "unrecognized arguments"
error adds the closest known flag (difflib, over the flags of every subcommand), so
``--judge-modl`` answers ``did you mean --judge-model?`` in one line. :func:`plain_text`
strips the reStructuredText of a docstring (````code````, ``**bold**``, ``:func:`x```)
for ``--help``, which prints it as written.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

__all__ = ["ArgumentParser", "plain_text"]


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup: ````x```` and ``*x*`` -> x,
    ``:func:`~a.b```/``:mod:`a``` -> ``b``/``a``."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1),
                  text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    return re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", text)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its subcommands' parsers."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that names the closest known flag of an unknown one."""

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            known = sorted(_flags(self))
            hints = []
            for arg in unknown.group(1).split():
                close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1) if arg.startswith("--") else []
                if close:
                    hints.append(f"{arg}: did you mean {close[0]}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")
