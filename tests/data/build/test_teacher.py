import pytest

from mmtune.data.build.config import PromptsConfig, TeacherConfig
from mmtune.data.build.sets import SetImage
from mmtune.data.build.teacher import Prompts, judge_config, teacher_client
from mmtune.evaluation.judge.client import JudgeError


def test_shipped_templates_fill_every_field():
    prompts = Prompts(PromptsConfig(per_image_pairs=2, cross_image_pairs=3))
    a = SetImage("e1", "/x/a.png", "a red planet", ("astronomy",), "about planets")
    b = SetImage("e2", "/x/b.png", "", (), "")
    per = prompts.per_image(a, "summary text")
    assert "a red planet" in per and "summary text" in per and "Write 2 question" in per and "$" not in per
    cross = prompts.cross_image([a, b], {"e1": "bg one"})
    assert "Image1: caption: a red planet" in cross and "Image2: caption: none" in cross
    assert "named Image1 to Image2" in cross and "Write 3 question" in cross
    assert "TEXT BODY" in prompts.summarize("TEXT BODY", ["t"])


def test_user_template_replaces_the_shipped_one_and_unknown_fields_fail(tmp_path):
    mine = tmp_path / "per_image.txt"
    mine.write_text('Describe: $caption. Reply {"qa": []} with $n_pairs pairs. Cost: $$5')
    prompts = Prompts(PromptsConfig(per_image=str(mine), per_image_pairs=4))
    text = prompts.per_image(SetImage("e", "p", "cap", (), ""), "")
    assert text == 'Describe: cap. Reply {"qa": []} with 4 pairs. Cost: $5'
    bad = tmp_path / "bad.txt"
    bad.write_text("$caption $colour")
    with pytest.raises(ValueError, match=r"bad.txt.*colour"):
        Prompts(PromptsConfig(cross_image=str(bad)))


def test_teacher_reads_its_own_environment_and_needs_a_model(tmp_path):
    cfg = judge_config(TeacherConfig(concurrency=3, send_images=False))
    assert cfg.model_env == "MMTUNE_TEACHER_MODEL" and cfg.api_key_env == "MMTUNE_TEACHER_API_KEY"
    assert cfg.concurrency == 3 and cfg.send_images is False
    client = teacher_client(TeacherConfig(), tmp_path / "c.sqlite", env={"MMTUNE_TEACHER_MODEL": "m"})
    assert client.model == "m"
    client.close()
    with pytest.raises(JudgeError):
        teacher_client(TeacherConfig(), tmp_path / "c.sqlite", env={"MMTUNE_JUDGE_MODEL": "judge-only"})
