"""Regenerate the README's pictures from a real demo run: the results viewer and the report's plots.

The pictures show a run, never a mock-up: the demo trains the tiny model, evaluates it
before and after training (each evaluation writes ``report.md``, its plots and
``viewer.html``), and this script photographs what those files show with headless Chromium.

Usage::

    python scripts/make_readme_figures.py                          # runs `mmtune demo` first (~3 min on CPU)
    python scripts/make_readme_figures.py --run outputs/demo       # reuse a finished demo run

Writes ``docs/images/viewer.png`` (the viewer on the held-out split after training, with
the worst dialogue selected) and ``docs/images/report_plots.png`` (the report's plots of
the evaluations before and after training, side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def find_chromium() -> str:
    found = os.environ.get("MMTUNE_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if not found:
        sys.exit("headless Chromium not found: `apt-get install chromium` (Debian) or set MMTUNE_CHROMIUM")
    return found


def screenshot(url: str, out: Path, *, width: int, height: int) -> None:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--virtual-time-budget=3000", f"--window-size={width},{height}",
               f"--screenshot={out}", url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if done.returncode != 0 or not out.is_file():
        sys.exit(f"chromium could not photograph {url}:\n{done.stderr[-2000:]}")


def worst_dialogue(eval_dir: Path) -> str:
    """The dialogue with the most wrong turns (ties: the most turns), so the picture shows a mistake."""
    wrong: dict[str, list[int]] = {}
    for line in (eval_dir / "details" / "synthetic.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        counts = wrong.setdefault(row["dialogue_id"], [0, 0])
        counts[0] += not row["correct"]
        counts[1] += 1
    return max(sorted(wrong), key=lambda d: tuple(wrong[d]))


def side_by_side(plots: list[tuple[str, Path]], out: Path) -> None:
    """The report PNGs in one row, each under its caption."""
    from PIL import Image, ImageDraw, ImageFont

    images = [(caption, Image.open(path).convert("RGB")) for caption, path in plots]
    font = ImageFont.load_default(size=18)
    pad, caption_h = 16, 32
    width = sum(img.width for _, img in images) + pad * (len(images) + 1)
    height = max(img.height for _, img in images) + caption_h + 2 * pad
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    x = pad
    for caption, img in images:
        draw.text((x + 8, pad), caption, fill=(30, 36, 48), font=font)
        canvas.paste(img, (x, pad + caption_h))
        x += img.width + pad
    canvas.save(out, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a finished `mmtune demo` output folder (default: run the demo)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    args = parser.parse_args(argv)
    find_chromium()  # fail before a three-minute training run, not after it
    run = args.run
    if run is None:
        run = REPO / "outputs" / "readme_demo"
        subprocess.run([sys.executable, "-m", "mmtune.cli", "demo", f"training.output_dir={run}",
                        "logging.progress_bar=false"], cwd=REPO, check=True)
    after, before = run / "eval" / "after", run / "eval" / "before"
    if not (after / "viewer.html").is_file():
        sys.exit(f"{after}: no viewer.html; pass --run a finished demo output folder (or omit --run)")
    args.out.mkdir(parents=True, exist_ok=True)

    viewer_png = args.out / "viewer.png"
    url = (after / "viewer.html").resolve().as_uri() + f"#b=synthetic&d={worst_dialogue(after)}"
    screenshot(url, viewer_png, width=1280, height=820)

    plots_png = args.out / "report_plots.png"
    plots = [(f"{label}: {p.name}", p) for label, folder in (("before training", before), ("after training", after))
             for p in sorted(folder.glob("*.png"))]  # no "before" folder when eval_before was off
    side_by_side(plots, plots_png)
    print(f"wrote {viewer_png} and {plots_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
