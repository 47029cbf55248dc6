"""Generic auto adapter: chat-template-driven turn segments, prefix-stability check, exact labels."""

import pytest
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example, flatten
from mmtune.models.auto import AutoAdapter, TemplateNotPrefixStableError
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.support.auto_checkpoints import labelled_runs

CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'image' -%}{{- '<image>' -}}{%- else -%}{{- c['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# counts the messages in a header: earlier tokens change as turns are added
UNSTABLE = "{{- messages | length | string + ' turns: ' -}}" + CHATML


@pytest.fixture(scope="module")
def llava():
    return build_adapter(ModelConfig(family="llava"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, llava):
    """A tiny random LLaVA saved as a normal HF checkpoint (model + processor + template)."""
    root = tmp_path_factory.mktemp("tiny_llava")
    llava.load_model().save_pretrained(root)
    llava.save_pretrained(root)
    return root


def _with_template(llava, tmp_path, template):
    processor = llava.processor
    old = processor.chat_template
    processor.chat_template = template
    try:
        processor.save_pretrained(tmp_path)
    finally:
        processor.chat_template = old
    llava.model_config.save_pretrained(tmp_path)
    return build_adapter(ModelConfig(family="auto", path=str(tmp_path)))


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "a.png"
    PILImage.new("RGB", (80, 60), (255, 0, 0)).save(path)
    return str(path)


def _dialogue(image):
    return Dialogue(
        "d",
        "t",
        (
            Turn("user", ("Image1: ", Image(image), ". What colour is the shape?")),
            Turn("assistant", ("red",)),
            Turn("user", ("And the shape?",)),
            Turn("assistant", ("A square.\nYes",)),
        ),
    )


def _spans(example):
    spans, current = [], []
    for label in example.labels:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_reproduces_the_llava_adapter_on_its_own_template(llava, checkpoint, image):
    auto = build_adapter(ModelConfig(family="auto", path=str(checkpoint)))
    assert isinstance(auto, AutoAdapter)
    dialogue = _dialogue(image)
    a = encode_example(llava, dialogue, max_length=None)
    b = encode_example(auto, dialogue, max_length=None)
    assert a.input_ids == b.input_ids and a.labels == b.labels
    assert [r.num_tokens for r in b.images] == [16]
    gen = Dialogue("g", "t", dialogue.turns[:3])
    ea = llava.encode_dialogue(gen, add_generation_prompt=True)
    eb = auto.encode_dialogue(gen, add_generation_prompt=True)
    assert flatten(ea, llava.image_token_id)[0] == flatten(eb, auto.image_token_id)[0]
    assert flatten(ea, llava.image_token_id)[0][-len(eb.suffix[0]):] == list(eb.suffix[0].ids)


def test_chatml_labels_are_content_plus_end_of_turn(llava, tmp_path, image):
    auto = _with_template(llava, tmp_path, CHATML)
    dialogue = _dialogue(image)
    example = encode_example(auto, dialogue, max_length=None)
    decoded = [auto.tokenizer.decode(s) for s in _spans(example)]
    assert decoded == ["red<|im_end|>\n", "A square.\nYes<|im_end|>\n"]
    rendered = auto.processor.apply_chat_template(
        [auto._message(t.role, t.segments) for t in dialogue.turns], tokenize=False
    )
    ids = auto.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    collapsed = [t for k, t in enumerate(example.input_ids) if not (t == auto.image_token_id and example.input_ids[k - 1] == t)]
    assert collapsed == ids
    last = encode_example(auto, dialogue, max_length=None, train_on="last_assistant")
    assert [auto.tokenizer.decode(s) for s in _spans(last)] == ["A square.\nYes<|im_end|>\n"]


def test_unstable_template_is_rendered_whole(llava, tmp_path, image):
    """A template whose earlier text changes as turns are added (a turn count in front) is rendered
    once per dialogue: the ids are the whole dialogue's render, each answer labelled as it appears."""
    auto = _with_template(llava, tmp_path, UNSTABLE)
    assert not auto._prefix_stable
    dialogue = _dialogue(image)
    example = encode_example(auto, dialogue, max_length=None)
    assert [auto.tokenizer.decode(s) for s in _spans(example)] == ["red<|im_end|>\n", "A square.\nYes<|im_end|>\n"]
    rendered = auto.processor.apply_chat_template([auto._message(t.role, t.segments) for t in dialogue.turns],
                                                  tokenize=False)
    assert rendered.startswith("4 turns: ")
    collapsed = [t for k, t in enumerate(example.input_ids) if not (t == auto.image_token_id and example.input_ids[k - 1] == t)]
    assert collapsed == auto.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    prompt = Dialogue("g", "t", dialogue.turns[:3])
    ids = flatten(auto.encode_dialogue(prompt, add_generation_prompt=True), auto.image_token_id)[0]
    want = auto.processor.apply_chat_template([auto._message(t.role, t.segments) for t in prompt.turns],
                                              tokenize=False, add_generation_prompt=True)
    collapsed = [t for k, t in enumerate(ids) if not (t == auto.image_token_id and ids[k - 1] == t)]
    assert want.startswith("3 turns: ") and collapsed == auto.tokenizer(want, add_special_tokens=False)["input_ids"]


# renders a message's content twice: the whole render cannot place the turns
TWICE = CHATML.replace("{{- '<|im_end|>\\n' -}}", "{{- '<|im_end|>\\n' -}}{%- if loop.last -%}"
                       "{%- for c in m['content'] -%}{%- if c['type'] == 'text' -%}{{- c['text'] -}}{%- endif -%}"
                       "{%- endfor -%}{%- endif -%}")


def test_template_the_whole_render_cannot_place_is_refused_at_start_up(llava, tmp_path):
    assert TWICE != CHATML
    with pytest.raises(TemplateNotPrefixStableError, match=r"dialogue 'processor-probe'.*not prefix-stable.*"
                                                           r"rendering the whole.*changes the render"):
        _with_template(llava, tmp_path, TWICE)


# numbers every message: what a turn adds depends on all the turns before it
NUMBERED = CHATML.replace("'<|im_start|>' + m['role']", "loop.index | string + '<|im_start|>' + m['role']")


def _long_dialogue(image, turns=11):
    out = []
    for k in range(turns):
        segments = ("Image: ", Image(image), f" question {k}?") if k % 3 == 0 else (f"question {k}?",)
        out += [Turn("user", segments), Turn("assistant", (f"answer {k}.",))]
    return Dialogue("long", "t", tuple(out))


@pytest.mark.parametrize("template", ["chatml", "numbered"])
def test_windowed_rendering_gives_the_every_prefix_spans(llava, tmp_path, image, template):
    auto = _with_template(llava, tmp_path, CHATML if template == "chatml" else NUMBERED)
    assert auto._windows_match is (template == "chatml")  # numbered turns differ in a window: every prefix
    dialogue = _long_dialogue(image)
    for system_prompt in (None, "Be brief."):
        for generation in (False, True):
            d = Dialogue(dialogue.id, dialogue.source, dialogue.turns[:-1]) if generation else dialogue
            messages = ([auto._message("system", (system_prompt,))] if system_prompt else []) + [
                auto._message(t.role, t.segments) for t in d.turns]
            roles = [t.role for t in d.turns]
            trainable = auto._trainable(roles, "all_assistant")
            defined = auto._spans_by_prefix(d.id, messages, len(messages) - len(roles), roles, trainable, 0,
                                            generation)
            windowed = auto._spans_by_window(messages, len(messages) - len(roles), roles, trainable, generation)
            assert windowed == (defined if template == "chatml" else None)
            text, spans, _ = auto._spans(d, system_prompt, "all_assistant", generation)
            assert (text, spans) == defined
            assert len(spans) == sum(2 if r == "assistant" else 1 for r in roles) + generation


def test_image_count_reads_only_the_header(checkpoint, tmp_path):
    auto = build_adapter(ModelConfig(family="auto", path=str(checkpoint)))
    full = tmp_path / "big.jpg"
    PILImage.effect_noise((800, 600), 64).convert("RGB").save(full, quality=90)
    header_only = tmp_path / "cut.jpg"
    header_only.write_bytes(full.read_bytes()[:2000])
    with pytest.raises(OSError):  # the pixels cannot be decoded from this file...
        PILImage.open(header_only).load()
    assert auto.image_token_count(Image(str(header_only))) == 16  # ...but its size can be read


def test_needs_a_checkpoint_path():
    with pytest.raises(ValueError, match="model.family=auto needs model.path"):
        AutoAdapter(ModelConfig(family="auto"))


def test_model_groups_and_dummy_loss(checkpoint):
    auto = build_adapter(ModelConfig(family="auto", path=str(checkpoint)))
    model = auto.load_model()
    groups = auto.module_groups(model)
    ids = [id(p) for g in (groups.vision, groups.projector, groups.language_model) for m in g for p in m.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    loss = auto.vision_dummy_loss(model)
    loss.backward()
    projector = groups.projector[0]
    assert loss.item() == 0.0
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in projector.parameters())


def test_inputs_that_no_join_reproduces_are_refused(checkpoint):
    from mmtune.models.auto import UnsupportedProcessorError

    auto = build_adapter(ModelConfig(family="auto", path=str(checkpoint)))
    one_by_one = auto._call

    def normalised_per_call(images, count=None):  # each image's values depend on the others of the call
        out = one_by_one(images, count)
        out["pixel_values"] = out["pixel_values"] - out["pixel_values"].mean()
        return out

    auto._call = normalised_per_call
    with pytest.raises(UnsupportedProcessorError, match=r"image input 'pixel_values' of two images .* no concatenation"):
        auto._probe_joins()


def test_remote_code_is_refused_unless_trusted(checkpoint, tmp_path):
    import json
    import shutil

    from mmtune.models.auto import RemoteCodeError

    shutil.copytree(checkpoint, tmp_path / "remote")
    config = json.loads((tmp_path / "remote" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (tmp_path / "remote" / "config.json").write_text(json.dumps(config))
    with pytest.raises(RemoteCodeError, match=r"needs code shipped with the checkpoint .*trust_remote_code=true"):
        build_adapter(ModelConfig(family="auto", path=str(tmp_path / "remote")))


def test_a_checkpoint_without_chat_template_is_refused(llava, tmp_path):
    from mmtune.models.auto import UnsupportedProcessorError

    import json

    llava.processor.save_pretrained(tmp_path)
    llava.model_config.save_pretrained(tmp_path)
    for name in ("chat_template.json", "chat_template.jinja"):
        (tmp_path / name).unlink(missing_ok=True)
    for name in ("tokenizer_config.json", "processor_config.json"):
        if (tmp_path / name).exists():
            values = json.loads((tmp_path / name).read_text())
            values.pop("chat_template", None)
            (tmp_path / name).write_text(json.dumps(values))
    with pytest.raises(UnsupportedProcessorError, match="has no chat template"):
        build_adapter(ModelConfig(family="auto", path=str(tmp_path)))


@pytest.fixture(scope="module")
def glm4v(tmp_path_factory):
    """A tiny GLM-4.1V checkpoint whose image limits let through what its processor refuses."""
    from mmtune.core.images import ImageLimits
    from mmtune.testing.checkpoints import save_tiny_checkpoint

    directory = save_tiny_checkpoint(str(tmp_path_factory.mktemp("glm4v")), "glm4v", weights=False)
    return build_adapter(ModelConfig(family="auto", path=directory, image_limits=ImageLimits(max_aspect_ratio=1e5)))


def test_an_image_the_processor_refuses_is_named_then_skipped_or_refused(glm4v, tmp_path):
    from mmtune.data.lengths import compute_lengths
    from mmtune.models.auto import UnsupportedImageError

    good, bad = str(tmp_path / "good.png"), str(tmp_path / "bad.png")
    PILImage.new("RGB", (60, 40)).save(good)
    PILImage.new("RGB", (1, 250)).save(bad)  # GLM-4.1V's processor refuses aspect ratios above 200
    fine = Dialogue("rec1", "train.jsonl", (Turn("user", ("a", Image(good))), Turn("assistant", ("b",))))
    refused = Dialogue("rec7", "train.jsonl", (Turn("user", ("a", Image(good))), Turn("assistant", ("b",)),
                                               Turn("user", (Image(bad), "c")), Turn("assistant", ("d",))))
    with pytest.raises(UnsupportedImageError, match=r"bad\.png.*dialogue 'rec7', turn 2 \(question\).*aspect ratio must be") as err:
        encode_example(glm4v, refused, max_length=None)
    assert err.value.code == "unsupported_image" and err.value.turn == 2
    table = compute_lengths(glm4v, [fine, refused], max_length=4096, image_errors="skip")
    assert table.lengths[0] > 0 and table.lengths[1] == 0
    [skipped] = table.image_skipped
    assert skipped["dialogue_id"] == "rec7" and skipped["reason"] == "unsupported_image"
    assert "bad.png" in skipped["detail"] and "turn 2" in skipped["detail"]
    with pytest.raises(UnsupportedImageError, match="rec7"):
        compute_lengths(glm4v, [fine, refused], max_length=4096, image_errors="strict")


def test_a_processor_output_that_cannot_be_stored_names_the_input_the_model_and_the_file(glm4v, tmp_path,
                                                                                         monkeypatch):
    """A conversion failure after a good decode (Llama 4's bfloat16 before mmtune widened it) is an
    ImageInputError naming the input, never a bad image file that skip modes would drop."""
    import mmtune.models.auto.batch as batch
    from mmtune.core.images import CorruptImageError, ImageInputError
    from mmtune.data.images import ImagePipeline

    good = str(tmp_path / "good.png")
    PILImage.new("RGB", (60, 40)).save(good)

    def refuse(value):
        raise TypeError(f"Got unsupported ScalarType {value.dtype}")

    monkeypatch.setattr(batch, "to_array", refuse)
    with pytest.raises(ImageInputError, match=r"good\.png.*'rec2', turn 2 \(question\).*its input 'pixel_values' "
                                              r"for model '.*glm4v.*TypeError: Got unsupported") as err:
        ImagePipeline(glm4v).load_one(good, dialogue_id="rec2", turn=2)
    assert not isinstance(err.value, CorruptImageError)


def test_an_answer_without_its_own_stop_token_learns_the_one_the_template_renders_next():
    """GLM-4.1V's template (and GLM-4.5V / 4.6V's) ends an answer with the next turn's ``<|user|>`` (a
    generation stop token), Janus's writes its EOS only between an answer and the next turn: it is labelled with
    the answer, appended after the last one; the classes whose answers carry their own
    end-of-turn stop token are left as they are."""
    from tests.support.auto_checkpoints import CLASSES
    from tests.support.auto_checkpoints import adapter as auto_adapter

    dialogue = Dialogue("g", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello",)),
                                   Turn("user", ("More",)), Turn("assistant", ("Bye",))))
    found = {kind: auto_adapter(kind)._answer_stop for kind in CLASSES}
    glm = auto_adapter("glm4v")
    user = glm.tokenizer.convert_tokens_to_ids("<|user|>")
    janus = auto_adapter("janus").tokenizer.eos_token_id
    # the GLM-V templates (GLM-4.1V's, GLM-4.5V / 4.6V's) end an answer with the next turn's <|user|>
    glm_user = {kind: auto_adapter(kind).tokenizer.convert_tokens_to_ids("<|user|>")
                for kind in ("glm4v", "glm4v_moe", "glm46v")}
    assert found == {kind: {**glm_user, "janus": janus}.get(kind) for kind in CLASSES}
    assert user in glm.stop_token_ids  # generation stops at it
    example = encode_example(glm, dialogue, max_length=None)
    runs = [glm.tokenizer.decode(run) for run in labelled_runs(example.labels)]
    assert runs == ["Hello<|user|>", "Bye<|user|>"]
    assert example.input_ids[-1] == user and example.input_ids.count(user) == 3




def test_a_template_without_any_stop_token_warns_and_answer_stop_eos_appends_the_eos(caplog):
    """llava-hf's LLaVA-NeXT template ends an answer with a space and renders no stop token
    anywhere: as rendered, the model never learns to stop, so start-up says so; with
    ``model.auto.answer_stop=eos`` every answer gets the tokenizer's EOS, labelled, and nothing
    else changes (the ids are the template's with one EOS after each answer)."""
    import logging

    from tests.support.auto_checkpoints import checkpoint

    path = checkpoint("llava_next")
    dialogue = Dialogue("n", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello",)),
                                   Turn("user", ("More",)), Turn("assistant", ("Bye",))))
    with caplog.at_level(logging.WARNING, logger="mmtune.models.auto"):
        as_rendered = build_adapter(ModelConfig(family="auto", path=path))
    assert "model.auto.answer_stop=eos" in caplog.text and path in caplog.text
    eos = as_rendered.tokenizer.eos_token_id
    plain = encode_example(as_rendered, dialogue, max_length=None)
    assert eos not in plain.input_ids
    assert [as_rendered.tokenizer.decode(r) for r in labelled_runs(plain.labels)] == [" Hello ", " Bye "]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmtune.models.auto"):
        stopping = build_adapter(ModelConfig(family="auto", path=path, **{"auto": {"answer_stop": "eos"}}))
    assert "answer_stop" not in caplog.text
    assert stopping.fingerprint() != as_rendered.fingerprint()  # cached encodings are not shared
    example = encode_example(stopping, dialogue, max_length=None)
    runs = labelled_runs(example.labels)
    assert [stopping.tokenizer.decode(r) for r in runs] == [" Hello </s>", " Bye </s>"]
    assert all(run[-1] == eos for run in runs) and example.input_ids.count(eos) == 2
    assert [i for i in example.input_ids if i != eos] == plain.input_ids
    # a prompt built by mmtune carries the EOS after the earlier answer, as in training
    prompt = Dialogue("n", "t", dialogue.turns[:3])
    prompt_ids = flatten(stopping.encode_dialogue(prompt, add_generation_prompt=True), stopping.image_token_id)[0]
    assert prompt_ids.count(eos) == 1 and prompt_ids == example.input_ids[: len(prompt_ids)]
    # training only the last answer: the same text, the earlier EOS unlabelled
    last = encode_example(stopping, dialogue, max_length=None, train_on="last_assistant")
    assert last.input_ids == example.input_ids
    assert [stopping.tokenizer.decode(r) for r in labelled_runs(last.labels)] == [" Bye </s>"]


def test_answer_stop_eos_leaves_a_template_with_its_own_stop_unchanged():
    from tests.support.auto_checkpoints import checkpoint

    dialogue = Dialogue("c", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello",))))
    path = checkpoint("internvl")
    default = encode_example(build_adapter(ModelConfig(family="auto", path=path)), dialogue, max_length=None)
    eos = encode_example(build_adapter(ModelConfig(family="auto", path=path, **{"auto": {"answer_stop": "eos"}})),
                         dialogue, max_length=None)
    assert (eos.input_ids, eos.labels) == (default.input_ids, default.labels)


def test_an_unknown_answer_stop_is_refused_at_start_up():
    with pytest.raises(ValueError, match=r"model\.auto\.answer_stop='always'.*'template', 'eos'"):
        ModelConfig(family="auto", path="unused", **{"auto": {"answer_stop": "always"}}).validate()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen4_exp"])
def test_qwen2_vl_family_routes_the_later_classes_of_the_line_to_the_auto_encoder(kind):
    """``model.family=qwen2_vl`` on a Qwen3.5 (or Qwen4-Exp: a class transformers pairs with
    Qwen3VLProcessor, routed without being named) checkpoint builds the auto adapter (its processor and
    template, positions from the model's own rope index); a qwen2_vl key it would ignore is refused."""
    from tests.support.auto_checkpoints import checkpoint

    path = checkpoint(kind)
    adapter = build_adapter(ModelConfig(family="qwen2_vl", path=path))
    assert isinstance(adapter, AutoAdapter) and adapter.config.family == "auto"
    assert adapter.position_id_rows == 3 and not adapter._prefix_stable and adapter.prefix_stable is False
    with pytest.raises(ValueError, match=r"(?s)model.family=qwen2_vl hands .* to the 'auto' family.*max_pixels"):
        build_adapter(ModelConfig(family="qwen2_vl", path=path, qwen2_vl={"max_pixels": 50176}))


def test_image_inputs_keep_the_processors_dtype_through_the_pixel_cache_format():
    """Llama 4's image processor returns bfloat16: the cached array (float32, which numpy and the
    pixel cache have) holds the same values and comes back as the same bfloat16 tensor."""
    import torch

    from mmtune.models.auto.batch import from_array, to_array

    value = torch.randn(3, 4, 5).to(torch.bfloat16)
    array = to_array(value)
    assert array.dtype.name == "float32"
    back = from_array(array, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back, value)
    assert from_array(to_array(torch.ones(2)), torch.float32).dtype == torch.float32


def test_a_text_change_mmtune_does_not_reproduce_is_refused_at_the_first_differing_token(monkeypatch):
    """Janus saved as transformers' conversion saves it prepends its default system prompt in its
    processor's call: without adding it, the start-up check names the first differing token."""
    import mmtune.models.authority as authority
    from mmtune.models.auto import UnsupportedProcessorError
    from tests.support.auto_checkpoints import adapter as auto_adapter

    janus = auto_adapter("janus")
    assert janus._text_change[0].startswith("You are a helpful language and vision assistant.")
    monkeypatch.setattr(authority, "_CHECKED", set())
    monkeypatch.setattr(janus, "_text_change", ("", ""))
    with pytest.raises(UnsupportedProcessorError, match=r"at token 1: the processor gives 'You', mmtune"):
        janus._check_authority()
