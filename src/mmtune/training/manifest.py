"""What a resumable checkpoint holds, written with it and checked before a resume loads it.

A checkpoint folder can lose files after it was saved: a partial copy to another machine,
a clean-up script, a file deleted by hand. Loading it then fails deep inside accelerate
with a raw ``No such file or directory`` naming whichever file it looked for first (not
always one the checkpoint ever had), and the previous complete checkpoint goes unused.

So every save writes ``manifest.json`` (each file's path inside the folder and its size
in bytes) into the folder it is writing, after the state and before the marker file
``trainer_state.json``, which stays last (:mod:`mmtune.training.checkpoint`). A resume
checks the folder against it first:

- ``training.resume=auto`` takes the newest checkpoint whose files are all there; if a
  newer one is incomplete, it says which one, what is missing, and which one it resumes
  from instead. When none is complete, it refuses, naming them.
- ``training.resume=<folder>`` on an incomplete checkpoint refuses, naming what is
  missing and the newest complete checkpoint of the same run, if any.

Sizes, not hashes: a missing or truncated file is what copies and clean-ups leave, and
checking sizes costs a ``stat`` per file. Checkpoints saved before manifests existed have
none and are loaded as before, unchecked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from mmtune.io.nofollow import open_output

__all__ = ["MANIFEST", "IncompleteCheckpointError", "write_manifest", "manifest_problems", "choose_resume_checkpoint"]

MANIFEST = "manifest.json"


class IncompleteCheckpointError(FileNotFoundError):
    """The checkpoint to resume from lacks files its manifest lists (or has them truncated)."""


def write_manifest(directory: str | os.PathLike, *, written_after: Iterable[str] = ()) -> Path:
    """Write ``<directory>/manifest.json``: every file below ``directory`` with its size.

    Args:
        written_after: names of files written into ``directory`` after the manifest (the
            marker file), left out of it.

    Returns:
        The manifest's path.
    """
    directory = Path(directory)
    later = {MANIFEST, *written_after}
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            relative = path.relative_to(directory).as_posix()
            if relative in later or path.is_symlink():
                continue
            files[relative] = path.stat().st_size
    target = directory / MANIFEST
    tmp = target.with_name(f".{MANIFEST}.tmp")
    with open_output(tmp, "w") as handle:
        json.dump({"files": dict(sorted(files.items()))}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)
    return target


def manifest_problems(directory: str | os.PathLike) -> Optional[list[str]]:
    """What ``directory`` lacks of its manifest: ``["model.safetensors: missing", ...]``.

    Returns:
        ``[]`` when every listed file is there with its size; ``None`` when the folder has
        no manifest (saved before manifests existed: nothing to check against).
    """
    directory = Path(directory)
    try:
        listed = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{MANIFEST}: unreadable ({err})"]
    problems = []
    for relative, size in listed.items():
        path = directory / relative
        if not path.is_file():
            problems.append(f"{relative}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{relative}: {path.stat().st_size} bytes, saved with {size}")
    return problems


def _described(checkpoint: Path, problems: list[str]) -> str:
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return f"{checkpoint} is incomplete ({shown})"


def choose_resume_checkpoint(requested: Optional[str], checkpoints: Callable[[], list[Path]],
                             step_of: Callable[[Path], object]) -> tuple[Optional[Path], Optional[str]]:
    """The checkpoint a run resumes from, checked against its manifest, and a note to print.

    Args:
        requested: ``training.resume``: ``None`` (no resume), ``"auto"`` or a folder.
        checkpoints: the run's complete checkpoints (marker file present), oldest first.
        step_of: a checkpoint's step, for messages.

    Returns:
        ``(checkpoint or None, note or None)``: the note says which newer checkpoints were
        passed over as incomplete and which one is used instead.

    Raises:
        IncompleteCheckpointError: the named checkpoint is incomplete, or with ``auto``
            every checkpoint is; the message names them, what they lack, and the newest
            complete checkpoint where there is one.
    """
    if requested is None:
        return None, None
    if requested != "auto":
        chosen = Path(requested)
        problems = manifest_problems(chosen)
        if not problems:
            return chosen, None
        intact = [c for c in reversed(checkpoints()) if not manifest_problems(c)
                  and os.path.realpath(c) != os.path.realpath(chosen)]
        way_out = (f"the newest complete checkpoint of this run is {intact[0]} (step {step_of(intact[0])}): rerun "
                   f"with training.resume={intact[0]} or training.resume=auto" if intact else
                   "this run has no other complete checkpoint: restore the missing files, or start afresh in "
                   "another training.output_dir")
        raise IncompleteCheckpointError(f"cannot resume: {_described(chosen, problems)}; {way_out}")
    passed_over = []
    for checkpoint in reversed(checkpoints()):
        problems = manifest_problems(checkpoint)
        if not problems:
            note = None
            if passed_over:
                note = ("training.resume=auto: " + "; ".join(passed_over) + f"; resuming from the newest complete "
                        f"checkpoint, {checkpoint} (step {step_of(checkpoint)}), instead")
            return checkpoint, note
        passed_over.append(_described(checkpoint, problems))
    if passed_over:
        raise IncompleteCheckpointError(
            "cannot resume (training.resume=auto): no checkpoint of this run is complete: " + "; ".join(passed_over)
            + ". Restore the missing files, or start afresh in another training.output_dir")
    return None, None
