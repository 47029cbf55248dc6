"""A generation file resumes only answers of the same weights, data and prompts."""

import json

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues
from mmtune.evaluation.config import EvalConfig, GenerationConfig, default_output_dir
from mmtune.evaluation.generation.fingerprint import weights_fingerprint
from mmtune.evaluation.generation.generator import DialogueGenerator, StaleGenerationsError
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


@pytest.fixture(scope="module")
def tiny():
    adapter = build_adapter(ModelConfig(family="llava"))
    return adapter, adapter.load_model(seed=0), adapter.load_model(seed=1)


@pytest.fixture(scope="module")
def dialogue(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "a.png"
    PILImage.new("RGB", (32, 32), "red").save(path)
    return Dialogue("d0", "t", (Turn("user", (Image(str(path)), " What colour?")), Turn("assistant", ("red",))))


CFG = GenerationConfig(max_new_tokens=3)


def _key(run, data="data.json"):
    return {"checkpoint": f"ckpt-{run}", "data": data, "about": {"run": run, "model": f"ckpt-{run}"}}


def test_weights_fingerprint_tracks_every_change(tiny):
    adapter, model, other = tiny
    assert weights_fingerprint(model) == weights_fingerprint(model)
    assert weights_fingerprint(model) != weights_fingerprint(other)
    again = adapter.load_model(seed=0)
    assert weights_fingerprint(again) == weights_fingerprint(model)
    with torch.no_grad():
        next(again.parameters()).view(-1)[1] += 1e-3
    assert weights_fingerprint(again) != weights_fingerprint(model)


def test_other_weights_refuse_to_resume_and_name_the_old_run(tiny, dialogue, tmp_path):
    adapter, model, other = tiny
    out = tmp_path / "gen.jsonl"
    DialogueGenerator(adapter, model, CFG).generate([dialogue], out_path=out, run_key=_key("first"))
    # same checkpoint name, other weights (a re-trained final/ at the same path)
    with pytest.raises(StaleGenerationsError, match=r"run 'first'.*\['weights'\]"):
        DialogueGenerator(adapter, other, CFG).generate([dialogue], out_path=out, run_key=_key("first"))
    with pytest.raises(StaleGenerationsError, match=r"\['checkpoint', 'weights'\]"):
        DialogueGenerator(adapter, other, CFG).generate([dialogue], out_path=out, run_key=_key("second"))
    with pytest.raises(StaleGenerationsError, match=r"\['data'\]"):
        DialogueGenerator(adapter, model, CFG).generate([dialogue], out_path=out, run_key=_key("first", "new.json"))
    same = DialogueGenerator(adapter, model, CFG)
    same.generate([dialogue], out_path=out, run_key=_key("first"))
    assert same.stats["turns"] == 0  # resumed, nothing generated again


def test_changed_question_refuses_to_resume(tiny, dialogue, tmp_path):
    adapter, model, _ = tiny
    out = tmp_path / "gen.jsonl"
    DialogueGenerator(adapter, model, CFG).generate([dialogue], out_path=out, run_key=_key("a"))
    changed = Dialogue("d0", "t", (Turn("user", (dialogue.images[0], " What shape?")), Turn("assistant", ("x",))))
    with pytest.raises(StaleGenerationsError, match="dialogue 'd0', turn 0 was generated for another question"):
        DialogueGenerator(adapter, model, CFG).generate([changed], out_path=out, run_key=_key("a"))


def test_each_checkpoint_gets_its_own_default_folder(tmp_path):
    model = ModelConfig(family="llava")
    a, b = tmp_path / "runs" / "a" / "final", tmp_path / "runs" / "b" / "final"
    folders = {default_output_dir("eval", str(a), model), default_output_dir("eval", str(b), model),
               default_output_dir("eval", None, model)}
    assert len(folders) == 3
    assert default_output_dir("eval", str(a), model).startswith("outputs/eval/eval/a-final-")
    from hydra import compose, initialize_config_dir

    from mmtune.data.config import configs_dir
    from mmtune.evaluation.config import register_configs, to_evaluate_config

    register_configs()
    with initialize_config_dir(config_dir=str(configs_dir().resolve()), version_base=None):
        cfg = to_evaluate_config(compose("evaluate", overrides=["eval.synthetic.data_path=x.json"]))
    assert cfg.output_dir is None  # the recipe fills in default_output_dir


def test_training_eval_folder_regenerates_instead_of_reporting_stale_answers(tiny, tmp_path):
    """A demo re-run in the same folder: the second model's score is its own."""
    from mmtune.data.synthetic import generate_synthetic
    from mmtune.training.evaluation import evaluate_in_training

    adapter, model, other = tiny
    data = generate_synthetic(tmp_path / "data", n_train=0, n_test=2, n_llava=0, image_size=32, max_turns=1)
    eval_cfg = EvalConfig(benchmarks=["synthetic"], progress=False, report=False,
                          generation=GenerationConfig(max_new_tokens=3, device="cpu"))
    eval_cfg.synthetic.data_path, eval_cfg.synthetic.image_root = data.test_json, data.image_dir

    class Cfg:
        eval = eval_cfg

    out = tmp_path / "eval" / "after"
    evaluate_in_training(model, adapter, Cfg, tag="after", run="demo", output_dir=str(out))
    def answers(path):  # keyed by (dialogue, turn): batched generation writes in completion order
        rows = (json.loads(line) for line in path.open())
        return {(r["dialogue_id"], r["turn"]): r["answer"] for r in rows}

    first = answers(out / "generations" / "synthetic.jsonl")
    evaluate_in_training(other, adapter, Cfg, tag="after", run="demo", output_dir=str(out))
    gens = out / "generations"
    second = answers(gens / "synthetic.jsonl")
    fresh = DialogueGenerator(adapter, other, eval_cfg.generation).generate(
        load_mmdu_dialogues(data.test_json, image_root=data.image_dir))
    assert second == {(r.dialogue_id, r.turn): r.answer for r in fresh} and second != first
    assert (gens / "synthetic.stale-1.jsonl").exists() and (gens / "synthetic.stale-1.settings.json").exists()
    assert answers(gens / "synthetic.stale-1.jsonl") == first


def test_an_empty_generations_file_is_checked_too(tiny, dialogue, tmp_path):
    """A run that has written its settings but no answer yet (it is answering its first turn,
    or stopped before it) owns the file: another model is refused, not let in to append."""
    adapter, model, other = tiny
    out = tmp_path / "gen.jsonl"
    DialogueGenerator(adapter, model, CFG).generate([], out_path=out, run_key=_key("first"))
    assert out.exists() and out.stat().st_size == 0
    with pytest.raises(StaleGenerationsError, match=r"was started \(no answer yet\).*run 'first'.*\['checkpoint', 'weights'\]"):
        DialogueGenerator(adapter, other, CFG).generate([dialogue], out_path=out, run_key=_key("second"))
    assert out.stat().st_size == 0
    records = DialogueGenerator(adapter, model, CFG).generate([dialogue], out_path=out, run_key=_key("first"))
    assert len(records) == 1 and len(out.read_text().splitlines()) == 1  # the same run resumes


HOLDER = r"""
import sys
from mmtune.evaluation.generation.records import GenerationsFile
held = GenerationsFile(sys.argv[1], {"model": "another", "about": {"run": "other-run"}}, [])
print("locked", flush=True)
sys.stdin.readline()  # hold the file until the test says so
held.close()
"""


def test_a_second_process_cannot_write_the_same_generations_file(tiny, dialogue, tmp_path):
    """Two processes answering into one generations file would interleave their lines: the
    second is refused, naming the first; once the first is gone, its settings (written before
    any answer) still keep another run's answers out of the file."""
    import subprocess
    import sys

    from mmtune.io.locks import DirectoryLockedError

    adapter, model, _ = tiny
    out = tmp_path / "generations" / "bench.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryLockedError, match=rf"in use by another process: pid {holder.pid}.*"
                                                        r"\(generation of bench\.jsonl\)"):
            DialogueGenerator(adapter, model, CFG).generate([dialogue], out_path=out, run_key=_key("first"))
        assert out.read_text() == ""  # nothing was written by the refused one
    finally:
        holder.communicate("\n", timeout=60)
    with pytest.raises(StaleGenerationsError, match=r"was started \(no answer yet\).*other-run"):
        DialogueGenerator(adapter, model, CFG).generate([dialogue], out_path=out, run_key=_key("first"))
    other = tmp_path / "generations" / "other.jsonl"  # another file of the same folder is free
    assert len(DialogueGenerator(adapter, model, CFG).generate([dialogue], out_path=other, run_key=_key("first"))) == 1
