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

Sizes and content: a missing or truncated file is what copies and clean-ups leave, and a
``stat`` per file finds it; a file overwritten in place keeps its size (random bytes written
into ``model.safetensors`` resumed a run into NaN losses), so the manifest also records a
fast content hash of every file (:data:`HASHES`: xxHash's XXH3-128 where the ``xxhash``
package is installed, else BLAKE2b-128 from the standard library), the marker file's
included (its bytes are known before it is written). A resume re-reads and hashes every
file of the checkpoint it is about to load; ``bench/checkpoint_hash.py`` measures what that
costs per GB. Manifests written before hashes existed are checked by size only, and the
resume says so; checkpoints saved before manifests existed have none and are loaded
unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from mmtune.io.nofollow import open_output

__all__ = ["MANIFEST", "HASHES", "IncompleteCheckpointError", "write_manifest", "manifest_problems",
           "verify_checkpoint", "file_hash", "choose_resume_checkpoint", "choose_resume_checkpoint_once"]

MANIFEST = "manifest.json"
_CHUNK = 4 << 20  # hashlib and xxhash release the GIL on large updates: files hash in parallel threads


def _xxh3_128() -> "Callable[[], object]":
    import xxhash

    return xxhash.xxh3_128


#: hash name -> a factory of objects with ``update`` / ``hexdigest``; the first one available writes
HASHES: dict[str, Callable[[], Callable[[], object]]] = {
    "xxh3_128": _xxh3_128,
    "blake2b-128": lambda: (lambda: hashlib.blake2b(digest_size=16)),
}


def _hasher(name: Optional[str] = None) -> tuple[str, Callable[[], object]]:
    """``(name, factory)`` of the hash ``name`` (``None``: the fastest one installed).

    Raises:
        ImportError: ``name`` needs a package that is not installed.
    """
    for candidate, load in HASHES.items():
        if name in (None, candidate):
            try:
                return candidate, load()
            except ImportError:
                if name is not None:
                    raise
    raise KeyError(f"unknown checkpoint hash {name!r}: one of {', '.join(HASHES)}")


def file_hash(path: str | os.PathLike, name: Optional[str] = None) -> str:
    """The hex content hash ``name`` (default: the fastest installed) of one file, read in chunks."""
    new = _hasher(name)[1]
    digest = new()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(paths: dict[str, Path], name: str) -> dict[str, str]:
    workers = min(8, os.cpu_count() or 1, max(1, len(paths)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(paths, pool.map(lambda p: file_hash(p, name), paths.values())))


class IncompleteCheckpointError(FileNotFoundError):
    """The checkpoint to resume from lacks files its manifest lists (or has them truncated)."""


def write_manifest(directory: str | os.PathLike, *, written_after: Iterable[str] = (),
                   later_contents: Optional[Mapping[str, bytes]] = None) -> Path:
    """Write ``<directory>/manifest.json``: every file below ``directory`` with its size and content hash.

    Args:
        written_after: names of files written into ``directory`` after the manifest (the
            marker file), left out of it.
        later_contents: the exact bytes of files written after the manifest (the marker
            file's): listed and hashed from these bytes, so that a resume checks them too.

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
            files[relative] = path
    name, new = _hasher()
    hashes = _hash_files(files, name)
    sizes = {relative: path.stat().st_size for relative, path in files.items()}
    for relative, content in (later_contents or {}).items():
        digest = new()
        digest.update(content)
        sizes[relative], hashes[relative] = len(content), digest.hexdigest()
    target = directory / MANIFEST
    tmp = target.with_name(f".{MANIFEST}.tmp")
    with open_output(tmp, "w") as handle:
        json.dump({"files": dict(sorted(sizes.items())), "hash": name, "hashes": dict(sorted(hashes.items()))},
                  handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)
    return target


def manifest_problems(directory: str | os.PathLike, *, contents: bool = True) -> Optional[list[str]]:
    """What ``directory`` lacks of its manifest: ``["model.safetensors: missing", ...]``.

    Every listed file must be there with its size and, with ``contents`` and a manifest that
    records hashes, its content hash (every file re-read: the cost ``bench/checkpoint_hash.py``
    measures). Sizes are checked first, so a missing file costs no hashing.

    Returns:
        ``[]`` when every listed file is intact; ``None`` when the folder has no manifest
        (saved before manifests existed: nothing to check against).
    """
    return verify_checkpoint(directory, contents=contents)[0]


def verify_checkpoint(directory: str | os.PathLike, *, contents: bool = True) -> tuple[Optional[list[str]], str]:
    """``(problems, note)``: each damaged file of a checkpoint named with what is wrong, and a note
    on what could not be checked (a manifest without hashes, a hash whose package is missing).

    ``problems`` is ``None`` when the folder has no manifest; see :func:`manifest_problems`.
    """
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        listed, hashes = manifest["files"], manifest.get("hashes") or {}
        if not isinstance(listed, dict) or not isinstance(hashes, dict):
            raise TypeError("'files' and 'hashes' must be objects")
    except FileNotFoundError:
        return None, f"{directory} has no {MANIFEST} (saved by an older mmtune): loaded unchecked"
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        return [f"{MANIFEST}: unreadable ({type(err).__name__}: {err})"], ""
    problems = []
    for relative, size in listed.items():
        path = directory / relative
        if not path.is_file():
            problems.append(f"{relative}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{relative}: {path.stat().st_size} bytes, saved with {size}")
    if problems or not contents:
        return problems, ""
    if not hashes:
        return [], f"{directory} was saved before checkpoints recorded content hashes: checked by file size only"
    try:
        name = _hasher(manifest.get("hash"))[0]
    except (ImportError, KeyError) as err:
        return [], f"{directory}: its content hash {manifest.get('hash')!r} cannot be computed here ({err}): " \
                   "checked by file size only"
    unhashed = sorted(set(listed) - set(hashes))
    found = _hash_files({r: directory / r for r in listed if r in hashes}, name)
    problems = [f"{relative}: content changed since it was saved ({name} {found[relative]}, saved with "
                f"{hashes[relative]})" for relative in sorted(found) if found[relative] != hashes[relative]]
    problems += [f"{relative}: no content hash recorded" for relative in unhashed]
    return problems, ""


def _described(checkpoint: Path, problems: list[str]) -> str:
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    state = "damaged" if any(": content changed" in p or p.startswith(MANIFEST) for p in problems) else "incomplete"
    return f"{checkpoint} is {state} ({shown})"


def _safe_step(step_of: Callable[[Path], object], checkpoint: Path) -> object:
    try:
        return step_of(checkpoint)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # an unreadable trainer_state.json
        return f"unknown: {type(err).__name__}"


def choose_resume_checkpoint(requested: Optional[str], checkpoints: Callable[[], list[Path]],
                             step_of: Callable[[Path], object]) -> tuple[Optional[Path], Optional[str]]:
    """The checkpoint a run resumes from, verified against its manifest, and a note to print.

    Args:
        requested: ``training.resume``: ``None`` (no resume), ``"auto"`` or a folder.
        checkpoints: the run's complete checkpoints (marker file present), oldest first.
        step_of: a checkpoint's step, for messages.

    Returns:
        ``(checkpoint or None, note or None)``: the note says which newer checkpoints were
        passed over as incomplete or damaged and which one is used instead, and what of the
        chosen one could not be checked (a manifest without hashes, no manifest).

    Raises:
        IncompleteCheckpointError: the named checkpoint is incomplete or damaged, or with
            ``auto`` every checkpoint is; the message names them, each bad file, and the
            newest intact checkpoint where there is one.
    """
    if requested is None:
        return None, None
    if requested != "auto":
        chosen = Path(requested)
        problems, unchecked = verify_checkpoint(chosen)
        if not problems:
            return chosen, unchecked or None
        intact = next((c for c in reversed(checkpoints()) if os.path.realpath(c) != os.path.realpath(chosen)
                       and not manifest_problems(c)), None)
        way_out = (f"the newest intact checkpoint of this run is {intact} (step {_safe_step(step_of, intact)}): "
                   f"rerun with training.resume={intact} or training.resume=auto" if intact is not None else
                   "this run has no other intact checkpoint: restore the damaged or missing files, or start "
                   "afresh in another training.output_dir")
        raise IncompleteCheckpointError(f"cannot resume: {_described(chosen, problems)}; {way_out}")
    passed_over = []
    for checkpoint in reversed(checkpoints()):
        problems, unchecked = verify_checkpoint(checkpoint)
        if not problems:
            notes = [unchecked] if unchecked else []
            if passed_over:
                notes.insert(0, "training.resume=auto: " + "; ".join(passed_over) + "; resuming from the newest "
                             f"intact checkpoint, {checkpoint} (step {_safe_step(step_of, checkpoint)}), instead")
            return checkpoint, "; ".join(notes) or None
        passed_over.append(_described(checkpoint, problems))
    if passed_over:
        raise IncompleteCheckpointError(
            "cannot resume (training.resume=auto): no checkpoint of this run is intact: " + "; ".join(passed_over)
            + ". Restore the damaged or missing files, or start afresh in another training.output_dir")
    return None, None


def choose_resume_checkpoint_once(accelerator: Any, requested: Optional[str], checkpoints: Callable[[], list[Path]],
                                  step_of: Callable[[Path], object]) -> tuple[Optional[Path], Optional[str]]:
    """:func:`choose_resume_checkpoint` on the main process alone, its answer (or refusal) given to every rank.

    Verifying re-reads every file of a checkpoint: once per job, not once per process.
    """
    answer: Any = None
    if accelerator.is_main_process:
        try:
            answer = ("chosen", *choose_resume_checkpoint(requested, checkpoints, step_of))
        except IncompleteCheckpointError as err:
            answer = ("refused", str(err), None)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        answer = broadcast_object_list([answer])[0]
    if answer[0] == "refused":
        raise IncompleteCheckpointError(answer[1])
    return answer[1], answer[2]
