"""A hostile model folder (family ``auto``) ends in one message naming its file, before anything
oversized is parsed, compiled or allocated; the published layouts pass."""

import json
import shutil

import pytest

from mmtune.core.images import ImageLimits
from mmtune.models.checkpoint_guard import (MAX_JSON_DEPTH, MAX_TEMPLATE_CHARS, ModelFileError, check_chat_template,
                                            check_model_folder, image_size_problems)
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random LLaVA saved as a normal HF checkpoint (model + processor + template)."""
    llava = build_adapter(ModelConfig(family="llava"))
    root = tmp_path_factory.mktemp("tiny_llava")
    llava.load_model().save_pretrained(root)
    llava.save_pretrained(root)
    return root


@pytest.fixture
def folder(checkpoint, tmp_path):
    shutil.copytree(checkpoint, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _load(folder):
    return build_adapter(ModelConfig(family="auto", path=str(folder)))


def _edit(file, change):
    values = json.loads(file.read_text())
    change(values)
    file.write_text(json.dumps(values))


def test_the_published_layout_loads(folder):
    assert _load(folder).chat_template


@pytest.mark.parametrize("key, value", [
    ("crop_size", {"height": 20000, "width": 20000}),
    ("size", {"shortest_edge": 20000}),
    ("max_pixels", 10**12),
    ("image_grid_pinpoints", [[336, 672], [20000, 336]]),
])
def test_a_processor_asking_for_huge_images_is_refused_naming_the_file_and_the_limit(folder, key, value):
    file = folder / "processor_config.json"  # its image_processor section (a preprocessor_config.json alike)
    _edit(file, lambda v: (v.get("image_processor", v)).__setitem__(key, value))
    with pytest.raises(ModelFileError) as info:
        _load(folder)
    message = str(info.value)
    assert message.startswith(f"{file}: the image processor asks for images larger than mmtune decodes")
    assert "model.image_limits.max_side=8192" in message or "model.image_limits.max_pixels=" in message


def test_image_sizes_are_held_against_the_configured_limits():
    limits = ImageLimits(max_side=1000, max_pixels=500_000)
    assert image_size_problems({"size": {"height": 900, "width": 900}}, limits) == [
        "size asks for 900 x 900 = 810000 pixels, above model.image_limits.max_pixels=500000"]
    assert image_size_problems({"size": {"shortest_edge": 336}, "crop_size": 336, "patch_size": 99999}, limits) == []


def _nested(depth):
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "processor_config.json"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 200_000])
def test_a_deeply_nested_json_file_is_refused_naming_it(folder, name, depth):
    file = folder / name
    text = file.read_text()
    file.write_text(text[:text.rindex("}")] + f', "deep": {_nested(depth)}' + "}")
    with pytest.raises(ModelFileError, match=rf"^{file}: nests lists/objects (deeper|more than)"):
        _load(folder)


def test_a_json_file_that_is_no_json_is_refused_naming_it(folder):
    (folder / "config.json").write_bytes(b"\x00\xff garbage")
    with pytest.raises(ModelFileError, match=rf"^{folder / 'config.json'}: is not valid JSON"):
        _load(folder)


def _template_source(folder):
    if (folder / "chat_template.jinja").is_file():
        return folder / "chat_template.jinja"
    return folder / "chat_template.json"


def _set_template(folder, template):
    source = _template_source(folder)
    if source.suffix == ".jinja":
        source.write_text(template)
    else:
        _edit(source, lambda v: v.__setitem__("chat_template", template))
    return source


def test_an_oversized_template_is_refused_before_jinja_compiles_it(folder, monkeypatch):
    import transformers.utils.chat_template_utils as utils

    compiled = []
    monkeypatch.setattr(utils, "_compile_jinja_template", lambda t: compiled.append(t))
    source = _set_template(folder, "{{ '" + "x" * (MAX_TEMPLATE_CHARS + 1) + "' }}")
    with pytest.raises(ModelFileError, match=rf"^{source}: a chat template of \d+ (bytes|characters), above the"):
        _load(folder)
    assert not compiled


@pytest.mark.parametrize("template, what", [
    ("{{ raise_exception('no images here') }}", r"fails on a three-message dialogue \(TemplateError: no images here"),
    ("{% for m in messages %}{{ m.content[0].nope.deeper }}{% endfor %}", "fails on a three-message dialogue"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'xxxxxxxx' }}{% endfor %}{% endfor %}",
     "renders a three-message dialogue to more than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}"
     "{% endfor %}{% endfor %}", r"does not finish rendering a three-message dialogue \(rendering took more than"),
    ("{% for m in messages %}{{ m.role }", "fails on a three-message dialogue"),
])
def test_a_template_that_raises_floods_or_loops_is_one_message_naming_its_file(folder, monkeypatch, template, what):
    import mmtune.models.checkpoint_guard as guard

    monkeypatch.setattr(guard, "RENDER_SECONDS", 1.0)
    source = _set_template(folder, template)
    with pytest.raises(ModelFileError, match=rf"^{source}: the chat template {what}"):
        _load(folder)


def test_remote_code_is_still_refused(folder):
    from mmtune.models.auto import RemoteCodeError

    _edit(folder / "config.json", lambda v: v.__setitem__("auto_map", {"AutoConfig": "custom.Config"}))
    with pytest.raises(RemoteCodeError, match="needs code shipped with the checkpoint"):
        _load(folder)


def test_a_hub_id_or_no_path_is_left_to_transformers():
    check_model_folder(None, ImageLimits())
    check_model_folder("some-org/some-model", ImageLimits())
    check_chat_template("{{ messages | length }}", "some-org/some-model", {})


def test_a_preprocessor_config_is_held_to_the_limits_too(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 20000}}))
    with pytest.raises(ModelFileError, match=rf"^{tmp_path / 'preprocessor_config.json'}: .*size.longest_edge=20000 "
                                             r"px is above model.image_limits.max_side=8192"):
        check_model_folder(tmp_path, ImageLimits())
    check_model_folder(tmp_path, ImageLimits(max_side=20000, max_pixels=20000 ** 2))


def test_pixel_budget_processors_have_their_size_edges_held_as_pixel_counts():
    qwen_like = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, "temporal_patch_size": 2}
    assert image_size_problems(qwen_like, ImageLimits()) == []
    qwen_like["size"]["longest_edge"] = 10**11
    assert image_size_problems(qwen_like, ImageLimits()) == [
        "size.longest_edge=100000000000 pixels is above model.image_limits.max_pixels=89478485"]


def test_an_oversized_tokenizer_or_json_file_is_refused_by_its_size_before_it_is_read(folder, monkeypatch):
    import mmtune.models.checkpoint_guard as guard

    monkeypatch.setattr(guard, "MAX_TOKENIZER_BYTES", 1000)  # a 256 MiB file is slow to write in a test
    with pytest.raises(ModelFileError, match=rf"^{folder / 'tokenizer.json'}: \d+ bytes, above the 1000-byte bound"):
        _load(folder)
    monkeypatch.setattr(guard, "MAX_TOKENIZER_BYTES", 1 << 30)
    monkeypatch.setattr(guard, "MAX_JSON_BYTES", 100)
    with pytest.raises(ModelFileError, match=r"config.json: \d+ bytes, above the 100-byte bound"):
        _load(folder)


def test_a_pending_alarm_of_the_caller_is_left_running():
    import signal

    previous = signal.signal(signal.SIGALRM, lambda *args: None)
    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        check_chat_template("{% for m in messages %}{{ m.role }}{% endfor %}", "some-org/some-model", {})
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 90
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
