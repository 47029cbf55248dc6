"""Writers into output folders never follow a symbolic link planted where their file goes."""

import json
import os
from pathlib import Path

import pytest

from mmtune.io.nofollow import OutputLinkError, open_output, save_figure, write_output_bytes, write_output_text

SECRET = "the target's own content\n"


def _plant(path: Path, kind: str, outside: Path) -> Path:
    """A symbolic link at ``path``: to an outside file, a dangling one, or to a folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        target = outside / "victim.txt"
        target.write_text(SECRET)
    elif kind == "dangling":
        target = outside / "not-yet.txt"
    else:
        target = outside / "folder"
        target.mkdir()
    path.symlink_to(target)
    return target


def _untouched(target: Path, kind: str) -> bool:
    if kind == "file":
        return target.read_text() == SECRET
    if kind == "dangling":
        return not target.exists()
    return target.is_dir() and not list(target.iterdir())


KINDS = ["file", "dangling", "folder"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["w", "a", "x", "wb", "ab"])
def test_no_mode_writes_through_a_link(tmp_path, kind, mode):
    outside = tmp_path / "outside"
    outside.mkdir()
    link = tmp_path / "out" / "report.md"
    target = _plant(link, kind, outside)
    with pytest.raises(OutputLinkError) as info:
        with open_output(link, mode) as handle:
            handle.write(b"overwritten" if "b" in mode else "overwritten")
    assert _untouched(target, kind) and link.is_symlink()
    message = str(info.value)
    assert str(link) in message and str(target) in message and "Remove the link" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileExistsError)  # printed as one message


def test_plain_files_are_written_created_and_appended(tmp_path):
    path = tmp_path / "a.txt"
    write_output_text(path, "one\n")
    with open_output(path, "a") as handle:
        handle.write("two\n")
    assert path.read_text() == "one\ntwo\n"
    write_output_bytes(path, b"three")
    assert path.read_bytes() == b"three"


def _writers(out: Path):
    """Every kind of writer into an output folder: (file it writes, how to call it)."""
    from mmtune.evaluation.generation.records import write_lines
    from mmtune.evaluation.reporting.report import write_report
    from mmtune.evaluation.results import BenchmarkResult, write_result
    from mmtune.io.locks import LOCK_FILE, lock_directory
    from mmtune.training.checkpoint import write_json_atomic
    from mmtune.training.logging import cut_jsonl_after
    from mmtune.training.manifest import write_manifest

    result = BenchmarkResult(benchmark="synthetic", run="r", model="m", metrics={"exact_match": 50.0},
                             counts={"turns": 2})
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')

    def figure(path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, _ = plt.subplots()
        save_figure(fig, path)
        plt.close(fig)

    return [
        (LOCK_FILE, lambda: lock_directory(out, purpose="a test").release()),
        (".state.json.tmp", lambda: write_json_atomic(out / "state.json", {"step": 1})),
        (".manifest.json.tmp", lambda: write_manifest(out)),
        ("synthetic.json.tmp", lambda: write_result(result, out)),
        ("report.md", lambda: write_report([result], out)),
        ("generations.jsonl.tmp", lambda: write_lines(out / "generations.jsonl", ["{}"])),
        (".metrics.jsonl.tmp", lambda: cut_jsonl_after(out / "metrics.jsonl", 1)),
        ("curves.png", lambda: figure(out / "curves.png")),
    ]


@pytest.mark.parametrize("kind", ["file", "dangling"])
def test_every_writer_refuses_a_planted_link_and_leaves_its_target_alone(tmp_path, kind):
    refused = []
    for index in range(8):
        out = tmp_path / f"out{index}"
        out.mkdir()
        name, write = _writers(out)[index]
        outside = tmp_path / f"outside{index}"
        outside.mkdir()
        target = _plant(out / name, kind, outside)
        with pytest.raises(OutputLinkError):
            write()
        assert _untouched(target, kind), name
        refused.append(name)
    assert len(refused) == 8


def test_an_atomic_write_replaces_a_link_at_its_final_name_not_its_target(tmp_path):
    from mmtune.training.checkpoint import write_json_atomic

    outside = tmp_path / "outside"
    outside.mkdir()
    target = _plant(tmp_path / "out" / "state.json", "file", outside)
    write_json_atomic(tmp_path / "out" / "state.json", {"step": 2})
    assert target.read_text() == SECRET
    assert not (tmp_path / "out" / "state.json").is_symlink()
    assert json.loads((tmp_path / "out" / "state.json").read_text()) == {"step": 2}


def test_the_folders_above_may_be_links(tmp_path):
    real = tmp_path / "disk2" / "runs"
    real.mkdir(parents=True)
    os.symlink(real, tmp_path / "outputs")  # outputs/ on another disk: the user's choice
    write_output_text(tmp_path / "outputs" / "report.md", "ok")
    assert (real / "report.md").read_text() == "ok"
