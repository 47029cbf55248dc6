"""The static results viewer: what `viewer.html` holds for each benchmark, built from an evaluation's files."""

import base64
import io
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.config import EvalConfig
from mmtune.evaluation.reporting.viewer import THUMBNAIL_PX, write_viewer
from mmtune.evaluation.runner import collect_entries, run_benchmarks


def payload(html_path):
    """The JSON data block embedded in the page."""
    text = html_path.read_text(encoding="utf-8")
    match = re.search(r'<script id="viewer-data" type="application/json">(.*?)</script>', text, re.S)
    assert match, "no data block in the page"
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_synthetic(tmp_path_factory.mktemp("syn"), n_train=0, n_test=5, n_llava=0, image_size=200,
                              min_images=2, max_images=3, max_turns=3)


WRONG = "purple </script><!-- <b>"


def _wrong_on_first_turns(test_json, path):
    """A generation file answering every first question wrongly (with markup that must stay text) and the rest correctly."""
    rows = []
    for record in json.loads(test_json.read_text()):
        answers = [c["value"] for c in record["conversations"] if c["from"] == "assistant"]
        for t, answer in enumerate(answers):
            rows.append({"dialogue_id": record["id"], "turn": t, "answer": WRONG if t == 0 else answer.upper()})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_synthetic_viewer_lists_dialogues_with_turns_images_and_scores(data, tmp_path):
    test_json = Path(data.test_json)
    predictions = tmp_path / "pred.jsonl"
    rows = _wrong_on_first_turns(test_json, predictions)
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False)
    cfg.synthetic.data_path, cfg.synthetic.image_root, cfg.synthetic.predictions = str(test_json), data.image_dir, str(predictions)
    out = tmp_path / "eval"
    run_benchmarks(cfg, output_dir=str(out), run_name="r", model_label="m")

    page = out / "viewer.html"
    assert page.is_file()
    data_block = payload(page)
    (bench,) = data_block["benchmarks"]
    records = json.loads(test_json.read_text())
    assert bench["name"] == "synthetic" and [e["id"] for e in bench["entries"]] == [r["id"] for r in records]
    first = bench["entries"][0]
    n_turns = sum(1 for c in records[0]["conversations"] if c["from"] == "user")
    assert len(first["turns"]) == n_turns
    # per dialogue: % of turns right; the first turn was answered wrong on purpose
    assert first["score"] == pytest.approx(100.0 * (n_turns - 1) / n_turns)
    assert first["turns"][0]["status"] == "wrong" and first["turns"][0]["answer"] == WRONG
    assert first["turns"][1]["status"] == "correct"
    assert first["turns"][0]["reference"] == records[0]["conversations"][1]["value"]
    assert first["turns"][0]["question"].startswith("Image1: [image #1].") and "<ImageHere>" not in first["turns"][0]["question"]
    # every image of the dialogue is shown, as an embedded thumbnail within the size cap
    keys = [k for t in first["turns"] for k in t["images"]]
    assert len(keys) == len(records[0]["image"])
    from PIL import Image

    uri = data_block["images"][keys[0]]
    assert uri.startswith("data:image/jpeg;base64,")
    thumb = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    assert max(thumb.size) <= THUMBNAIL_PX < 200
    # summary metrics, the report's plot and a link both ways between report and viewer
    assert bench["summary"]["metrics"]["exact_match"] == pytest.approx(100.0 * (len(rows) - len(records)) / len(rows))
    # the page links the report as HTML (not raw Markdown), and the report links back
    assert "synthetic_by_turn.png" in data_block["plots"] and data_block["report"] == "report.html"
    assert "[viewer.html](viewer.html)" in (out / "report.md").read_text()
    report_html = (out / "report.html").read_text()
    assert '<a href="viewer.html">viewer.html</a>' in report_html and "data:image/png;base64," in report_html
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", report_html)
    # no network: nothing in the page is fetched from elsewhere
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page.read_text())


def test_images_are_linked_relatively_past_the_embedding_budget(data, tmp_path):
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False)
    cfg.synthetic.data_path, cfg.synthetic.image_root = data.test_json, data.image_dir
    out = tmp_path / "eval"
    (out / "details").mkdir(parents=True)
    (out / "details" / "synthetic.jsonl").write_text("")
    page = write_viewer(collect_entries(cfg, out), out, embed_budget_bytes=0)
    sources = payload(page)["images"]
    assert sources and all(not s.startswith("data:") for s in sources.values())
    for key, rel in sources.items():
        assert (out / rel).resolve() == Path(key).resolve()


def test_mmdu_viewer_shows_judge_scores_reply_and_dimension_facets(data, tmp_path):
    cfg = EvalConfig(benchmarks=["mmdu"], progress=False)
    cfg.mmdu.data_path, cfg.mmdu.image_root = data.test_json, data.image_dir
    out = tmp_path / "eval"
    (out / "details").mkdir(parents=True)
    records = json.loads(open(data.test_json).read())
    dims = {"C": 2.0, "R": 3.0, "VP": 4.0, "LC": 5.0, "AA": 6.0, "IRU": 7.0, "Overall": 3.0}
    # detail rows number turns from 1, as the viewer shows them
    rows = [{"dialogue_id": records[0]["id"], "turn": 1, "status": "ok", "scores": dims, "na": [], "detail": "json",
             "reply": "The answer names the wrong colour.\n{...}"},
            {"dialogue_id": records[0]["id"], "turn": 2, "status": "failed", "scores": {}, "na": [], "detail": "HTTP 500"}]
    (out / "details" / "mmdu.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    entries = {e["id"]: e for e in payload(write_viewer(collect_entries(cfg, out), out))["benchmarks"][0]["entries"]}
    first = entries[records[0]["id"]]
    assert first["turns"][0]["scores"]["Overall"] == 3.0
    assert first["turns"][0]["rationale"].startswith("The answer names the wrong colour")
    assert first["turns"][1]["status"] == "failed" and first["turns"][1]["rationale"] == "HTTP 500"
    # dialogue score: MMDU's all-turns rule (x10), unscored turns count 0
    n = len(first["turns"])
    assert first["score"] == pytest.approx(10 * 3.0 / n) and first["facets"]["dim:IRU"] == pytest.approx(10 * 7.0 / n)


def test_mmvet_and_mdi_items_carry_their_facets(tmp_path):
    from PIL import Image

    root = tmp_path / "images"
    root.mkdir()
    Image.new("RGB", (400, 300), (10, 20, 30)).save(root / "a.png")
    mmvet = {"v1_0": {"imagename": "a.png", "question": "What?", "answer": "x", "capability": ["ocr", "spat"]},
             "v1_1": {"imagename": "a.png", "question": "Why?", "answer": "y", "capability": ["rec"]}}
    (tmp_path / "mm-vet.json").write_text(json.dumps(mmvet))
    mdi = [{"question number": 7, "key": "level2-sport-old", "image_path": "a.png", "question": "How many?",
            "option": "A.1; B.2", "answer": "B", "response": "A"}]
    (tmp_path / "mdi.json").write_text(json.dumps(mdi))
    cfg = EvalConfig(benchmarks=["mmvet", "mdi"], progress=False)
    cfg.mmvet.data_path, cfg.mmvet.image_root = str(tmp_path / "mm-vet.json"), str(root)
    cfg.mdi.predictions, cfg.mdi.image_root = str(tmp_path / "mdi.json"), str(root)
    out = tmp_path / "eval"
    (out / "details").mkdir(parents=True)
    (out / "mmvet_results.json").parent.mkdir(exist_ok=True)
    (out / "mmvet_results.json").write_text(json.dumps({"v1_0": "x!", "v1_1": "z"}))
    (out / "details" / "mmvet.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"id": "v1_0", "run": 0, "score": 1.0, "tries": 1, "status": "ok"},
        {"id": "v1_0", "run": 1, "score": 0.5, "tries": 1, "status": "ok"},
        {"id": "v1_1", "run": 0, "score": 0.0, "tries": 1, "status": "ok"}]) + "\n")
    run_benchmarks(EvalConfig(benchmarks=["mdi"], progress=False, mdi=cfg.mdi), output_dir=str(out), run_name="r", model_label="m")
    benches = {b["name"]: b for b in payload(write_viewer(collect_entries(cfg, out), out))["benchmarks"]}
    vet = {e["id"]: e for e in benches["mmvet"]["entries"]}
    assert vet["v1_0"]["score"] == pytest.approx(75.0) and vet["v1_0"]["facets"]["capability"] == ["ocr", "spat"]
    assert vet["v1_0"]["turns"][0]["answer"] == "x!" and vet["v1_0"]["turns"][0]["scores"] == {"run 0": 1.0, "run 1": 0.5}
    assert benches["mmvet"]["facets"] == ["capability"]
    (item,) = benches["mdi"]["entries"]
    assert item["id"] == "7" and item["score"] == 0.0 and item["facets"] == {"level": "level2", "scenario": "sport", "age": "old"}
    assert "B.2" in item["turns"][0]["question"] and item["turns"][0]["reference"] == "B"


def test_no_viewer_without_per_item_details(tmp_path):
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False)
    assert write_viewer(collect_entries(cfg, tmp_path), tmp_path) is None and not (tmp_path / "viewer.html").exists()


# ---------------------------------------------------------------- in a real browser
CHROMIUM = os.environ.get("MMTUNE_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
ARTIFACTS = Path(os.environ.get("MMTUNE_TEST_ARTIFACTS", Path(__file__).resolve().parents[3] / ".artifacts"))


class _Elements(HTMLParser):
    """Elements of a dumped DOM, as (tag, attributes) pairs."""

    def __init__(self):
        super().__init__()
        self.found = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))

    def with_class(self, name):
        return [a for _, a in self.found if name in (a.get("class") or "").split()]


def _chromium(*args, profile):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not found: `apt-get install chromium` or set MMTUNE_CHROMIUM")
def test_viewer_in_headless_chromium_lists_items_and_shows_the_selected_dialogue(data, tmp_path):
    test_json = Path(data.test_json)
    predictions = tmp_path / "pred.jsonl"
    _wrong_on_first_turns(test_json, predictions)
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False)
    cfg.synthetic.data_path, cfg.synthetic.image_root, cfg.synthetic.predictions = str(test_json), data.image_dir, str(predictions)
    out = tmp_path / "eval"
    run_benchmarks(cfg, output_dir=str(out), run_name="browser", model_label="m")
    records = json.loads(test_json.read_text())
    chosen = records[2]
    url = (out / "viewer.html").resolve().as_uri() + f"#b=synthetic&d={chosen['id']}"

    dumped = _chromium("--virtual-time-budget=3000", "--dump-dom", url, profile=tmp_path / "profile-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = _Elements()
    dom.feed(dumped.stdout)
    rows = dom.with_class("item")
    assert [r["data-id"] for r in rows if "data-id" in r] and len(rows) == len(records)
    assert [r["data-id"] for r in dom.with_class("selected")] == [chosen["id"]]
    (detail,) = [a for _, a in dom.found if a.get("id") == "detail"]
    assert detail["data-id"] == chosen["id"]
    turns = dom.with_class("turn")
    assert len(turns) == sum(c["from"] == "user" for c in chosen["conversations"])
    # every image of the dialogue rendered as a thumbnail, from the page itself (data: URI)
    images = [a for tag, a in dom.found if tag == "img" and a.get("src", "").startswith("data:image/jpeg")]
    assert len(images) == len(chosen["image"])
    assert "status-wrong" in turns[0]["class"]  # the first answers were wrong on purpose
    assert "purple &lt;/script&gt;&lt;!-- &lt;b&gt;" in dumped.stdout  # shown as text, not markup

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "viewer_synthetic.png"
    taken = _chromium("--virtual-time-budget=3000", "--window-size=1400,900", f"--screenshot={shot}", url,
                      profile=tmp_path / "profile-shot")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1400, 900)
        assert len(img.convert("RGB").getcolors(1 << 20)) > 50  # drawn, not a blank page
    print(f"\nviewer screenshot: {shot}")


def test_cross_run_report_html_links_each_result_to_its_viewer(data, tmp_path):
    from mmtune.evaluation.reporting.tables import collect_results, render_html

    predictions = tmp_path / "pred.jsonl"
    _wrong_on_first_turns(Path(data.test_json), predictions)
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False)
    cfg.synthetic.data_path, cfg.synthetic.image_root, cfg.synthetic.predictions = data.test_json, data.image_dir, str(predictions)
    with_viewer, without = tmp_path / "a", tmp_path / "b"
    run_benchmarks(cfg, output_dir=str(with_viewer), run_name="a", model_label="m")
    without.mkdir()
    (without / "synthetic.json").write_text((with_viewer / "synthetic.json").read_text().replace('"run": "a"', '"run": "b"'))
    page = render_html([], collect_results([tmp_path]), {})
    assert page.count("viewer.html") == 1 and (with_viewer / "viewer.html").resolve().as_uri() in page


def _scored_dialogue(tmp_path, images):
    """An evaluation folder of one synthetic dialogue that shows ``images``, scored from answers."""
    bench = tmp_path / "bench" / "test.json"
    bench.parent.mkdir(exist_ok=True)
    question = " ".join("<ImageHere>" for _ in images) + " What is shown?"
    bench.write_text(json.dumps([{"id": "d0", "image": [str(p) for p in images], "conversations": [
        {"from": "user", "value": question}, {"from": "assistant", "value": "red"}]}]))
    predictions = tmp_path / "pred.jsonl"
    predictions.write_text(json.dumps({"dialogue_id": "d0", "turn": 0, "answer": "red"}) + "\n")
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False)
    cfg.synthetic.data_path, cfg.synthetic.predictions = str(bench), str(predictions)
    return cfg


def _png_header(width, height):
    """The first bytes of a PNG declaring ``width x height`` (8-bit grey) and no pixel data."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + chunk(b"IEND", b"")


def test_bombs_and_broken_images_are_placeholders_with_their_reason(tmp_path):
    """The page comes after the scores: no image may fail it, and none is decoded past the limits."""
    from PIL import Image

    root = tmp_path / "bench"
    root.mkdir()
    Image.new("L", (1, 30000)).save(root / "thin.png", optimize=True)  # ~140 bytes; a 30000-px canvas
    (root / "bomb.png").write_bytes(_png_header(30000, 30000))  # 900 M pixels: PIL refuses to open it
    (root / "big.png").write_bytes(_png_header(9000, 9000))  # 81 M pixels: PIL opens it, model.image_limits do not
    (root / "cut.png").write_bytes((root / "thin.png").read_bytes()[:60])  # a header, then nothing
    Image.new("RGB", (40, 30), "red").save(root / "ok.png")
    images = [root / name for name in ("thin.png", "bomb.png", "big.png", "cut.png", "ok.png")]
    cfg = _scored_dialogue(tmp_path, images)
    out = tmp_path / "eval"
    results = run_benchmarks(cfg, output_dir=str(out), run_name="r", model_label="m")
    assert results["synthetic"].metrics["exact_match"] == 100.0
    data_block = payload(out / "viewer.html")
    sources, problems = data_block["images"], data_block["image_problems"]
    thin, bomb, big, cut, ok = (str(p) for p in images)
    assert sources[ok].startswith("data:image/jpeg;base64,") and ok not in problems
    assert sources[thin] == sources[bomb] == sources[big] == sources[cut] == ""  # neither embedded nor linked
    assert "aspect ratio of 30000:1" in problems[thin] and "max_aspect_ratio" in problems[thin]
    assert "PIL refuses it" in problems[bomb] and "decompression bomb" in problems[bomb]
    assert "9000 px is above model.image_limits.max_side=8192" in problems[big]
    assert problems[cut].startswith("not shown: ")
    assert "4 not shown" in data_block["note"]
    page = (out / "viewer.html").read_text()
    assert "image_problems" in page  # the page script shows the reason in the placeholder


def test_the_viewer_honours_allow_absolute_image_paths_like_the_loaders(tmp_path):
    from PIL import Image

    outside = tmp_path / "elsewhere" / "a.png"
    outside.parent.mkdir()
    Image.new("RGB", (40, 30), "red").save(outside)
    cfg = _scored_dialogue(tmp_path, [outside])
    with pytest.raises(ValueError, match="path_outside_root"):  # refused at load without the permission
        run_benchmarks(cfg, output_dir=str(tmp_path / "refused"), run_name="r", model_label="m")
    cfg.allow_absolute_image_paths = True
    out = tmp_path / "eval"
    run_benchmarks(cfg, output_dir=str(out), run_name="r", model_label="m")
    data_block = payload(out / "viewer.html")
    assert data_block["images"][str(outside)].startswith("data:image/jpeg;base64,")
    assert data_block["benchmarks"][0]["entries"][0]["turns"][0]["images"] == [str(outside)]


def _before_and_after(data, tmp_path):
    """A run folder with eval/before (every answer wrong) and eval/after (first answers wrong)."""
    test_json = Path(data.test_json)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({"dialogue_id": r["id"], "turn": t, "answer": "no idea"}) + "\n"
                             for r in json.loads(test_json.read_text())
                             for t in range(sum(c["from"] == "user" for c in r["conversations"]))))
    after = tmp_path / "after.jsonl"
    _wrong_on_first_turns(test_json, after)
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False)
    cfg.synthetic.data_path, cfg.synthetic.image_root = str(test_json), data.image_dir
    run = tmp_path / "run"
    for tag, predictions in (("before", wrong), ("after", after)):
        cfg.synthetic.predictions = str(predictions)
        run_benchmarks(cfg, output_dir=str(run / "eval" / tag), run_name="run", model_label=tag)
    return run


def test_the_viewer_shows_the_runs_answers_before_training_beside_these(data, tmp_path):
    run = _before_and_after(data, tmp_path)
    block = payload(run / "eval" / "after" / "viewer.html")
    (bench,) = block["benchmarks"]
    assert block["baseline_label"] == "before training" and block["baseline_viewer"] == "../before/viewer.html"
    assert bench["baseline_summary"]["metrics"]["exact_match"] == 0.0
    for entry in bench["entries"]:
        before = bench["baseline"][entry["id"]]
        assert before["score"] == 0.0 and len(before["turns"]) == len(entry["turns"])
        assert all(t["answer"] == "no idea" and t["status"] == "wrong" for t in before["turns"])
    # the evaluation before training has nothing to compare with
    assert payload(run / "eval" / "before" / "viewer.html")["benchmarks"][0]["baseline"] == {}


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not found: `apt-get install chromium` or set MMTUNE_CHROMIUM")
def test_before_and_after_side_by_side_in_headless_chromium(data, tmp_path):
    run = _before_and_after(data, tmp_path)
    records = json.loads(Path(data.test_json).read_text())
    chosen = records[1]
    url = (run / "eval" / "after" / "viewer.html").resolve().as_uri() + f"#b=synthetic&d={chosen['id']}"
    dumped = _chromium("--virtual-time-budget=3000", "--dump-dom", url, profile=tmp_path / "profile")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = _Elements()
    dom.feed(dumped.stdout)
    assert len(dom.with_class("before-score")) == len(records)  # a "before" column in the list ...
    assert {a["class"].split()[-1] for a in dom.with_class("delta")} <= {"delta-pos", "delta"}  # ... and the change
    n_turns = sum(c["from"] == "user" for c in chosen["conversations"])
    assert len(dom.with_class("compare")) == n_turns  # each turn: both answers side by side
    assert len(dom.with_class("before")) == n_turns and len(dom.with_class("after")) == n_turns
    assert dumped.stdout.count("no idea") >= n_turns and "answer before training (wrong)" in dumped.stdout
    assert '<a href="../before/viewer.html">answers before training</a>' in dumped.stdout
