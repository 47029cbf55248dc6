"""A training run states what data it left out: at start-up, in data_report.json and at the end."""

import json

import pytest

from mmtune.training.config import to_sft_config
from mmtune.training.demo import compose_sft_config
from mmtune.training.loop import SFTRecipe


@pytest.fixture
def data_with_a_cut_image(tmp_path):
    from mmtune.data.synthetic import generate_synthetic

    paths = generate_synthetic(tmp_path / "data", n_train=8, n_test=2, n_llava=0, seed=0, image_size=56)
    first = json.loads(open(paths.train_json).read())[0]
    victim = tmp_path / "data" / "images" / first["image"][0].lstrip("/")
    victim.write_bytes(victim.read_bytes()[:60])  # header intact, pixels cut
    return tmp_path / "data", first["id"], victim


def _recipe(tmp_path, data_dir, *extra):
    overrides = ["experiment=demo", f"training.output_dir={tmp_path / 'run'}", f"synthetic.out_dir={data_dir}",
                 "synthetic.enabled=false", f"data.cache_dir={tmp_path / 'cache'}", "training.epochs=1",
                 "training.eval_before=false", "training.eval_after=false", "logging.progress_bar=false",
                 "collator.batch_size=1", *extra]
    return SFTRecipe(to_sft_config(compose_sft_config(overrides)))


def test_skip_mode_run_survives_a_cut_image_and_reports_it(tmp_path, data_with_a_cut_image, capsys):
    data_dir, victim_id, victim = data_with_a_cut_image
    recipe = _recipe(tmp_path, data_dir, "data.validation.mode=skip", "data.validation.check_images=exists")
    recipe.setup()
    start = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert start["trainable_samples"] == 8 and start["sources"][0]["source"] == "synthetic_mmdu"
    recipe.train()
    recipe.cleanup()
    out = capsys.readouterr().out
    assert "data: 8 trainable samples" in out
    assert "1 samples left out during training because an image failed to decode" in out
    assert victim_id in out and str(victim) in out
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["sources"][0]["corrupt_images"] == 1


def test_run_with_no_sample_fitting_the_window_says_why(tmp_path, data_with_a_cut_image):
    data_dir, _, _ = data_with_a_cut_image
    recipe = _recipe(tmp_path, data_dir, "collator.max_length=16", "data.validation.check_images=exists")
    with pytest.raises(ValueError, match=r"source synthetic_mmdu: all 8 samples are longer than the 16-token window"):
        recipe.setup()
