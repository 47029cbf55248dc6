"""docs/own_data.md, run as written: write files -> data check -> train -> evaluate -> report.

The commands come from the page itself: every fenced bash block after a
``<!-- test: run -->`` comment runs, in page order, as a bash script in an empty folder,
with ``mmtune`` and ``python`` being this interpreter and this source tree. Every path
the commands print must exist afterwards, and the evaluate and report commands the page
shows must be the ones ``mmtune train`` prints. The 8-GPU block (``<!-- test: parse -->``)
is checked without GPUs: its ``mmtune plan`` runs, its ``mmtune evaluate checkpoint ...
--processes 8`` and ``mmtune report`` run on the tiny checkpoint with 2 processes, its
other commands are parsed by the CLIs' own parsers and config schemas.

The run as written trains 150 steps (about half a minute on an idle 2-core machine, more
under load); the same commands with ``training.max_steps=10`` added to the train command still
take about 40 s there, so both are marked slow (CI runs them after the default suite); the
8-GPU block's check runs by default.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import mmtune

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "own_data.md"
BLOCK = re.compile(r"<!-- test: (run|parse) -->\s*\n```bash\n(.*?)\n```", re.S)


def page_blocks(kind: str) -> list[str]:
    """The page's fenced bash blocks marked ``<!-- test: <kind> -->``, in page order."""
    return [body for marker, body in BLOCK.findall(PAGE.read_text()) if marker == kind]


def commands(block: str) -> list[str]:
    """A block's commands, one string each: continuation lines joined, comments dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def the_command(prefix: str, kind: str = "run") -> str:
    """The one command of the page's ``kind`` blocks that starts with ``prefix``."""
    found = [c for block in page_blocks(kind) for c in commands(block) if c.startswith(prefix)]
    assert len(found) == 1, f"docs/own_data.md should show one `{prefix} ...` command ({kind}), has {found}"
    return found[0]


@pytest.fixture
def shell(tmp_path):
    """``run(script)``: bash in an empty folder where ``mmtune`` / ``python`` are this tree's."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    # wrappers that exec this interpreter by its own path, never symlinks to it: a virtualenv's
    # python reached through a link elsewhere misses its pyvenv.cfg and runs without its packages
    for name, args in (("mmtune", ' -m mmtune.cli "$@"'), ("python", ' "$@"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args}\n')
        (bin_dir / name).chmod(0o755)
    src = str(Path(mmtune.__file__).resolve().parents[1])
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
           "MMTUNE_CACHE_DIR": str(tmp_path / "cache"), "WANDB_MODE": "offline"}

    def run(script: str) -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{script}\nexit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        return done.stdout

    run.cwd = work
    return run


def printed(label: str, text: str) -> str:
    """The value of the line ``<label> <value>`` a command printed (one such line)."""
    found = re.findall(rf"^\s*{re.escape(label)}\s+(.+?)\s*$", text, re.M)
    assert len(found) == 1, f"expected one line {label!r} in:\n{text}"
    return found[0]


def test_the_commands_run_this_interpreter_with_its_packages(shell):
    # a virtualenv's interpreter reached through a symlink elsewhere runs as the base interpreter
    # (other prefix, other packages): both commands the page uses must be this one, this environment
    probe = "import sys, mmtune; print(sys.prefix, sys.exec_prefix, mmtune.__file__)"
    expected = f"{sys.prefix} {sys.exec_prefix} {mmtune.__file__}"
    assert shell(f"python -c '{probe}'").strip() == expected
    assert shell(f"python - <<'EOF'\n{probe}\nEOF").strip() == expected  # as the page's first block runs it


def test_the_page_marks_its_blocks():
    runs = page_blocks("run")
    assert len(runs) == 6 and len(page_blocks("parse")) == 1
    assert [next(c.split()[:2] for c in commands(b) if c.startswith("mmtune")) for b in runs[2:]] == [
        ["mmtune", "data"], ["mmtune", "train"], ["mmtune", "evaluate"], ["mmtune", "report"]]


@pytest.mark.parametrize("extra", [pytest.param((), marks=pytest.mark.slow, id="as-written"),
                                   pytest.param(("training.max_steps=10",), marks=pytest.mark.slow, id="10-steps")])
def test_the_walkthrough_runs_and_every_printed_path_exists(shell, extra):
    images, write_files, check, train, evaluate, report = page_blocks("run")
    shell(images)
    shell(write_files)
    assert {p.name for p in (shell.cwd / "mydata").iterdir()} == {"imgs", "chat.json", "pairs.jsonl", "heldout.jsonl"}

    checked = shell(check)
    assert "data check: OK, all 5 record(s) of 2 source(s) kept" in checked
    assert "format llava (detected" in checked and "format messages (detected" in checked

    train_script = re.sub(r"\s*\\\n\s*", " ", train)
    assert train_script.count("mmtune train ") == 1
    trained = shell(train_script.rstrip() + "".join(f" {o}" for o in extra))
    final = shell.cwd / printed("checkpoint:", trained)
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    assert (final / "mmtune_run.json").is_file()
    run_folder = shell.cwd / printed("run folder:", trained).split(" (")[0]
    steps = [json.loads(line)["step"] for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == (10 if extra else 150)
    assert (shell.cwd / printed("eval before", trained)).is_file()
    # the page shows the commands training prints, so following the page is following the CLI
    assert printed("evaluate it:", trained) == the_command("mmtune evaluate")
    assert printed("then report:", trained) == the_command("mmtune report")
    # the same command again is refused with the message the page shows, and the first run is kept
    first = (run_folder / "metrics.jsonl").read_bytes()
    again = shell(train_script.rstrip() + "".join(f" {o}" for o in extra) + " 2>&1 || echo exit $?")
    shown = re.search(r"^mmtune train: outputs/mine holds an earlier run .*$", PAGE.read_text(), re.M).group(0)
    assert again.splitlines()[-2:] == [shown, "exit 2"] and (run_folder / "metrics.jsonl").read_bytes() == first

    evaluated = shell(evaluate)
    result = json.loads((shell.cwd / printed("result heldout:", evaluated)).read_text())
    assert result["run"] == "mine" and result["benchmark"] == "heldout" and result["counts"]["dialogues"] == 2
    viewer = (shell.cwd / printed("viewer:", evaluated)).read_text()
    assert "held-1" in viewer and "held-2" in viewer
    assert (shell.cwd / printed("report:", evaluated)).is_file()

    reported = shell(report)
    wrote = re.findall(r"(outputs/[\w./-]+\.(?:html|md|json|png))", printed("wrote", reported))
    assert "outputs/mine/report/report.html" in wrote
    html = (shell.cwd / "outputs/mine/report/report.html").read_text()
    assert "../eval/after/viewer.html" in html and "../eval/before/viewer.html" in html

    # every path any command printed, and every path the page names under outputs/, exists now
    text = trained + evaluated + reported + PAGE.read_text().split("## The same on 8 GPUs")[0]
    named = set(re.findall(r"(?<![\w/.-])((?:outputs/mine|mydata)(?:/[\w.-]+)*)", text))
    assert {"outputs/mine/final", "outputs/mine/eval/after/viewer.html", "outputs/mine/report/report.html"} <= named
    assert not [p for p in sorted(named) if not (shell.cwd / p).exists()]

    # the 8-GPU section's evaluate and report commands run as written on this checkpoint, with
    # 2 processes instead of 8 (gloo on CPU): the same scores as the one-process evaluation
    *_, evaluate_8, report_8 = commands(page_blocks("parse")[0])
    assert "--run mine_7b --processes 8" in evaluate_8
    shell("mkdir -p outputs/mine_7b && cp -r outputs/mine/final outputs/mine_7b/final")
    spread = shell("OMP_NUM_THREADS=1 " + evaluate_8.replace("--processes 8", "--processes 2"))
    two = json.loads((shell.cwd / printed("result heldout:", spread)).read_text())
    assert two["run"] == "mine_7b" and two["meta"]["data_parallel"]["processes"] == 2
    assert (two["metrics"], two["counts"]) == (result["metrics"], result["counts"])
    assert "outputs/mine_7b/report/report.html" in shell(report_8)


def test_the_8_gpu_commands_plan_and_parse(shell, monkeypatch):
    from mmtune.compose import compose_checked
    from mmtune.evaluation.cli import build_parser
    from mmtune.evaluation.config import to_evaluate_config
    from mmtune.training.cli import evaluate_command, report_command
    from mmtune.training.config import apply_data_files, to_sft_config

    for block in page_blocks("run")[:2]:  # the images and data files the commands name
        shell(block)
    plan, launch, before, after, report = commands(page_blocks("parse")[0])

    planned = shell(plan)
    assert "model       llava  path=llava-hf/llava-1.5-7b-hf" in planned
    assert "8 GPU(s), DeepSpeed ZeRO-3  [training.backend.engine=deepspeed (launch/accelerate/single_node_8gpu_zero3.yaml)" in planned

    words = shlex.split(launch)
    assert words[:4] == ["accelerate", "launch", "--config_file", "launch/accelerate/single_node_8gpu_zero3.yaml"]
    assert (ROOT / words[3]).is_file() and words[4:7] == ["-m", "mmtune", "train"]
    monkeypatch.chdir(shell.cwd)  # data.files are relative to the folder the command runs in
    raw = compose_checked(words[7:], "sft", command="mmtune train")
    apply_data_files(raw)
    cfg = to_sft_config(raw)
    assert (cfg.model.path, cfg.peft.method, cfg.training.mixed_precision) == ("llava-hf/llava-1.5-7b-hf", "lora", "bf16")
    assert not cfg.training.eval_before and not cfg.training.eval_after  # refused under ZeRO-3 on several processes
    # what this run prints at its end is what the page shows next (the page adds --processes 8)
    command, ready = evaluate_command(cfg, Path(cfg.training.output_dir) / "final")
    assert ready and after == command + " --processes 8"
    assert report == report_command(cfg)

    assert shlex.split(before)[:2] == ["mmtune", "evaluate"]
    evaluate_cfg = to_evaluate_config(compose_checked(shlex.split(before)[2:], "evaluate", command="mmtune evaluate"))
    assert evaluate_cfg.model.path == "llava-hf/llava-1.5-7b-hf" and evaluate_cfg.eval.benchmarks == ["heldout"]
    assert Path(evaluate_cfg.output_dir) == Path(cfg.training.output_dir) / "eval" / "before"
    args = build_parser().parse_args(shlex.split(after)[2:])
    assert (args.benchmark, args.processes, args.out) == ("heldout", 8, f"{cfg.training.output_dir}/eval/after")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "docs/own_data.md", "docs/data.md", "docs/data_building.md",
                                  "docs/reproduction.md"])
def test_links_between_the_pages_lead_to_a_file_and_heading(page):
    source = ROOT / page
    text = source.read_text()
    broken = []
    for target, anchor in re.findall(r"\]\(([\w./-]+\.md)?(?:#([\w-]+))?\)", text):
        path = (source.parent / target) if target else source
        if not path.is_file():
            broken.append(f"{target} (no such file)")
            continue
        headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
        if anchor and anchor not in headings:
            broken.append(f"{target}#{anchor} (no such heading)")
    assert not broken, f"{page}: {broken}"


def test_the_pages_lead_to_the_walkthrough_and_the_downloads():
    assert "](docs/own_data.md)" in (ROOT / "README.md").read_text()
    assert "](own_data.md)" in (ROOT / "docs" / "data.md").read_text()
    assert "](data.md#downloading-the-public-data)" in (ROOT / "docs" / "reproduction.md").read_text()
