"""Token-exact agreement with the official LLaVA-1.5 and InternLM-XComposer2 training code.

The golden vectors under ``../shared/fixtures/golden`` were produced by the official
preprocessing code on sample dialogues, with the real Llama-2 and InternLM2 tokenizers
(``../shared/fixtures/tokenizers``). Each case's native record goes through the normal
path (reader -> Dialogue -> adapter -> encoder); every image's run of image-token ids is
collapsed to one ``-200`` and the result must equal the official ``input_ids`` and
``labels`` token for token.
"""

import json
import os
import shutil

import pytest

from mmtune.data.encoding import encode_example
from mmtune.data.readers import parse_record
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.normpath(os.path.join(REPO, "..", "shared", "fixtures"))
IMAGE_MARKER = -200

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(FIXTURES, "golden")),
    reason=f"golden template fixtures not found in {FIXTURES} (clone the shared fixtures next to the repository)",
)


def _cases(name):
    path = os.path.join(FIXTURES, "golden", name)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def llava_checkpoint(directory):
    """A llava-hf style directory with the real Llama-2 tokenizer (``<image>`` = 32000)."""
    from transformers import AutoTokenizer, LlavaConfig, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from mmtune.models.llava import TINY_ARCHITECTURE

    source = os.path.join(directory, "source")
    os.makedirs(source)
    for name in ("tokenizer.model", "tokenizer.json"):
        shutil.copy(os.path.join(FIXTURES, "tokenizers", "llama2", name), source)
    with open(os.path.join(source, "tokenizer_config.json"), "w") as handle:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "add_bos_token": True, "legacy": False}, handle)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.pad_token = "<pad>"
    out = os.path.join(directory, "llava")
    # the real 336 px CLIP grid (576 image tokens); tiny widths: no weights are built here
    arch = {**TINY_ARCHITECTURE, "text_config": {**TINY_ARCHITECTURE["text_config"], "vocab_size": 32064},
            "vision_config": {**TINY_ARCHITECTURE["vision_config"], "image_size": 336}}  # fmt: skip
    LlavaConfig(**arch, image_token_id=32000).save_pretrained(out)
    LlavaProcessor(
        image_processor=LlavaImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
    ).save_pretrained(out)  # fmt: skip
    shutil.copy(os.path.join(source, "tokenizer.model"), out)
    return out


def xc2_official_directory(directory):
    """An official XComposer2-VL directory as released: config.json and only ``tokenizer.model``
    plus its ``tokenizer_config.json`` (whose tokenizer class is remote code, never run)."""
    os.makedirs(directory, exist_ok=True)
    shutil.copy(os.path.join(FIXTURES, "tokenizers", "internlm2", "tokenizer.model"), directory)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump({
            "auto_map": {"AutoTokenizer": ["tokenization_internlm_xcomposer2.InternLMXComposer2Tokenizer", None]},
            "tokenizer_class": "InternLMXComposer2Tokenizer", "bos_token": "<s>", "eos_token": "</s>",
            "pad_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        }, handle)  # fmt: skip
    official = {
        "architectures": ["InternLMXComposer2ForCausalLM"], "model_type": "internlmxcomposer2",
        "auto_map": {"AutoModel": "modeling_internlm_xcomposer2.InternLMXComposer2ForCausalLM"},
        "vocab_size": 92544, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 1000000, "rope_scaling": {"type": "dynamic", "factor": 1.0},
        "bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(official, handle)
    return directory


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_adapter(ModelConfig(family="llava", path=llava_checkpoint(str(tmp_path_factory.mktemp("llava")))))


@pytest.fixture(scope="module")
def xc2(tmp_path_factory):
    path = xc2_official_directory(str(tmp_path_factory.mktemp("xc2") / "official"))
    return build_adapter(ModelConfig(family="internlm_xcomposer2", path=path, image_size=490))


def collapse_images(ids, labels, image_token_id):
    """Each run of ``image_token_id`` -> one ``-200`` (every label in the run must be ignored)."""
    out_ids, out_labels, k = [], [], 0
    while k < len(ids):
        if ids[k] == image_token_id:
            end = k
            while end < len(ids) and ids[end] == image_token_id:
                end += 1
            assert all(label == IGNORE_INDEX for label in labels[k:end]), f"labelled image positions at {k}"
            out_ids.append(IMAGE_MARKER)
            out_labels.append(IGNORE_INDEX)
            k = end
        else:
            out_ids.append(ids[k])
            out_labels.append(labels[k])
            k += 1
    return out_ids, out_labels


def encode_case(adapter, case):
    dialogue = parse_record(case["native_format"], case["native_record"])
    example = encode_example(adapter, dialogue, max_length=None)
    images = sum(1 for _ in example.images)
    ids, labels = collapse_images(example.input_ids, example.labels, adapter.image_token_id)
    assert ids.count(IMAGE_MARKER) == images
    return ids, labels


def _piece(adapter, token_id, marker):
    if token_id == IMAGE_MARKER:
        return marker
    if token_id == IGNORE_INDEX:
        return "(no loss)"
    return adapter.tokenizer.convert_ids_to_tokens(int(token_id))


def assert_same(adapter, case, got, want, what, marker):
    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    show = lambda seq: repr(_piece(adapter, seq[k], marker)) if k < len(seq) else "(end)"  # noqa: E731
    context = [_piece(adapter, t, marker) for t in case["input_ids"][max(0, k - 6) : k + 4]]
    pytest.fail(
        f"{case['id']}: {what} differ first at position {k} (lengths {len(got)} vs official {len(want)}): "
        f"mmtune {got[k] if k < len(got) else None} {show(got)} vs official "
        f"{want[k] if k < len(want) else None} {show(want)}; official tokens around it: {context}"
    )


@pytest.mark.parametrize("case", _cases("llava_v1.json"), ids=lambda c: c["id"])
def test_llava_v1_matches_the_official_preprocessing(llava, case):
    ids, labels = encode_case(llava, case)
    assert_same(llava, case, ids, case["input_ids"], "input_ids", "<image>")
    assert_same(llava, case, labels, case["labels"], "labels", "<image>")


@pytest.mark.parametrize("case", _cases("xc2.json"), ids=lambda c: c["id"])
def test_xcomposer2_matches_the_official_preprocessing(xc2, case):
    ids, labels = encode_case(xc2, case)
    assert_same(xc2, case, ids, case["input_ids"], "input_ids", "<ImageHere>")
    assert_same(xc2, case, labels, case["labels"], "labels", "<ImageHere>")


def test_golden_tokens_agree_with_sentencepiece():
    """The fixtures themselves: the official ``tokens`` are the SentencePiece pieces of the ids."""
    import sentencepiece as spm

    for name, model in (("llava_v1.json", "llama2"), ("xc2.json", "internlm2")):
        sp = spm.SentencePieceProcessor(model_file=os.path.join(FIXTURES, "tokenizers", model, "tokenizer.model"))
        for case in _cases(name):
            pieces = [sp.id_to_piece(i) if i >= 0 else None for i in case["input_ids"]]
            assert [p for p in pieces if p] == [t for t, i in zip(case["tokens"], case["input_ids"]) if i >= 0]


# -- a second, independent statement of the official LLaVA-1.5 rules, for dialogues that have
# -- no golden vector: prompt string -> chunks at <image> -> pieces at </s> -> SentencePiece,
# -- labels by the round-length arithmetic of the official preprocessing.


def _official_llava(sp, turns, has_image):
    from mmtune.models.llava import VICUNA_V1_SYSTEM

    prompt = VICUNA_V1_SYSTEM + " "
    for role, text in turns:
        prompt += ("USER: " + text + " ") if role == "user" else ("ASSISTANT: " + text + "</s>")

    def encode(text):  # a slow tokenizer call with BOS: special tokens split out, the rest SentencePiece
        ids = [1]
        for k, part in enumerate(text.split("</s>")):
            if k:
                ids.append(2)
            if part:
                ids.extend(sp.encode(part))
        return ids

    def encode_images(text):
        ids = [1]
        for k, chunk in enumerate(text.split("<image>")):
            if k:
                ids.append(IMAGE_MARKER)
            ids.extend(encode(chunk)[1:])
        return ids

    tok = encode_images if has_image else encode
    ids = tok(prompt)
    labels = list(ids)
    cur = 1
    labels[:1] = [IGNORE_INDEX]
    for rou in prompt.split("</s>"):
        if not rou:
            break
        parts = rou.split(" ASSISTANT: ")
        if len(parts) != 2:
            break
        round_len = len(tok(rou))
        instruction_len = len(tok(parts[0] + " ASSISTANT: ")) - 2
        labels[cur : cur + instruction_len] = [IGNORE_INDEX] * instruction_len
        cur += round_len
    labels[cur:] = [IGNORE_INDEX] * (len(labels) - cur)
    assert cur == len(ids)
    return ids, labels


_USER_TEXTS = [
    "What is shown here?", "  Describe it.  ", "Compare <image> and <image> please.", "<image>\nWhat now?",
    "Look: <image>", "Is it raining? \n", "1889 or 1907?", "日本語の質問ですか？", "a  b   c", "<image> <image> Two.",
    "Tabs\tand\nnewlines\n\n", " <image>, then text", "Ends with space ",
]
_ANSWERS = ["Yes.", " A red helmet.\n", "1. One\n2. Two", "No  way", "It is 42.", "  Leading spaces", "中文回答。", "ok "]


def _random_turns(rng):
    """1-4 exchanges of texts drawn from the lists above, as ``(role, text)`` pairs."""
    turns = []
    for _ in range(rng.randint(1, 4)):
        turns += [("user", rng.choice(_USER_TEXTS)), ("assistant", rng.choice(_ANSWERS))]
    return turns


def test_llava_v1_agrees_with_the_official_rules_on_varied_dialogues(llava):
    """Random multi-turn MMDU-style dialogues (placeholders anywhere, odd whitespace)."""
    import random

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(FIXTURES, "tokenizers", "llama2", "tokenizer.model"))
    rng = random.Random(0)
    for n in range(60):
        turns = _random_turns(rng)
        images = sum(text.count("<image>") for _, text in turns)
        record = {"id": f"r{n}", "conversations": [
            {"from": role, "value": text.replace("<image>", "<ImageHere>")} for role, text in turns]}  # fmt: skip
        if images:
            record["image"] = [f"p{k}.jpg" for k in range(images)]
        want_ids, want_labels = _official_llava(sp, turns, has_image=images > 0)
        case = {"id": record["id"], "input_ids": want_ids}
        ids, labels = encode_case(llava, {**case, "native_format": "mmdu", "native_record": record})
        assert_same(llava, case, ids, want_ids, "input_ids", "<image>")
        assert_same(llava, case, labels, want_labels, "labels", "<image>")
        # the length pass counts what the encoder produces
        dialogue = parse_record("mmdu", record)
        fixed, turns, _, _ = llava.measure_many([dialogue])[0]
        assert fixed + sum(turns) == len(encode_example(llava, dialogue, max_length=None).input_ids)


def _official_xc2(sp, turns, has_image):
    """conv2text (strip, headers, </s>) -> parts at <ImageHere>, each encoded alone (BOS on the
    first), special tokens split out -> the positional label masking of the official code."""
    text = "".join(
        ("[UNUSED_TOKEN_146]user\n" if role == "user" else "[UNUSED_TOKEN_146]assistant\n")
        + value.strip() + "[UNUSED_TOKEN_145]\n"
        for role, value in turns
    ) + "</s>"  # fmt: skip

    def encode(part):
        ids = []
        for k, piece in enumerate(part.split("</s>")):
            if k:
                ids.append(2)
            if piece:
                ids.extend(sp.encode(piece))
        return ids

    ids = [1]
    for k, part in enumerate(text.split("<ImageHere>") if has_image else [text]):
        if k:
            ids.append(IMAGE_MARKER)
        ids.extend(encode(part))
    labels = list(ids)
    ends, last = 0, 0
    for i, token in enumerate(ids):
        if token == 92542:
            if ends % 2 == 0:
                labels[last : i + 6] = [IGNORE_INDEX] * len(labels[last : i + 6])
            else:
                last = i + 1
            ends += 1
        elif token == 2:
            labels[i + 1 :] = [IGNORE_INDEX] * len(labels[i + 1 :])
            break
    labels = [IGNORE_INDEX if t == IMAGE_MARKER else label for t, label in zip(ids, labels)]
    return ids, labels


def test_xcomposer2_agrees_with_the_official_rules_on_varied_dialogues(xc2):
    import random

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(FIXTURES, "tokenizers", "internlm2", "tokenizer.model"))
    rng = random.Random(1)
    for n in range(60):
        turns = [(role, text.replace("<image>", "<ImageHere>")) for role, text in _random_turns(rng)]
        images = sum(text.count("<ImageHere>") for _, text in turns)
        record = {"id": f"x{n}", "conversations": [{"from": role, "value": text} for role, text in turns]}
        if images:
            record["image"] = [f"p{k}.jpg" for k in range(images)]
        want_ids, want_labels = _official_xc2(sp, turns, has_image=images > 0)
        case = {"id": record["id"], "input_ids": want_ids}
        ids, labels = encode_case(xc2, {**case, "native_format": "xcomposer2", "native_record": record})
        assert_same(xc2, case, ids, want_ids, "input_ids", "<ImageHere>")
        assert_same(xc2, case, labels, want_labels, "labels", "<ImageHere>")


def test_xcomposer2_final_eos_loss_is_an_option(tmp_path):
    """``label_final_eos=false``: the same ids, no loss on the "\\n" and "</s>" after the last answer."""
    path = xc2_official_directory(str(tmp_path / "official"))
    adapter = build_adapter(ModelConfig(family="internlm_xcomposer2", path=path, image_size=490, label_final_eos=False))
    case = _cases("xc2.json")[0]
    ids, labels = encode_case(adapter, case)
    assert ids == case["input_ids"]
    want = case["labels"][:-2] + [IGNORE_INDEX, IGNORE_INDEX]
    assert case["labels"][-2:] != [IGNORE_INDEX, IGNORE_INDEX] and labels == want


def _messages(dialogue):
    out = []
    for turn in dialogue.turns:
        content = [{"type": "image"} if not isinstance(s, str) else {"type": "text", "text": s} for s in turn.segments]
        out.append({"role": turn.role, "content": content})
    return out


def _starts_a_chunk_with_whitespace(dialogue):
    """Text right after an image or a role header that starts with whitespace: there the
    fast (Rust) Llama tokenizer splits runs of spaces differently from SentencePiece."""
    for turn in dialogue.turns:
        previous = None
        for segment in turn.segments:
            if isinstance(segment, str) and (previous is None or not isinstance(previous, str)):
                if segment[:1] == " ":
                    return True
            previous = segment
    return False


def test_saved_llava_chat_template_gives_the_training_ids(llava, tmp_path):
    """A saved checkpoint's chat template, applied by plain transformers to the real Llama
    tokenizer, reproduces the training ids (one ``<image>`` id per image)."""
    from transformers import AutoTokenizer

    llava.save_pretrained(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    dialogues = [parse_record(c["native_format"], c["native_record"]) for c in _cases("llava_v1.json")]
    checked = [(c, d) for c, d in zip(_cases("llava_v1.json"), dialogues) if not _starts_a_chunk_with_whitespace(d)]
    assert len(checked) >= 4
    for case, dialogue in checked:
        example = encode_example(llava, dialogue, max_length=None)
        want, _ = collapse_images(example.input_ids, example.labels, llava.image_token_id)
        want = [llava.image_token_id if t == IMAGE_MARKER else t for t in want]
        got = tokenizer.apply_chat_template(_messages(dialogue), tokenize=True)
        got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
        assert_same(llava, {**case, "input_ids": want}, list(got), want, "chat-template ids", "<image>")


def test_official_tokenizer_loads_without_remote_code_and_encodes_as_sentencepiece(xc2, tmp_path):
    import sentencepiece as spm

    from mmtune.models.internlm_xcomposer2 import InternLM2Tokenizer, convert_official_tokenizer

    sp = spm.SentencePieceProcessor(model_file=os.path.join(FIXTURES, "tokenizers", "internlm2", "tokenizer.model"))
    assert isinstance(xc2.tokenizer, InternLM2Tokenizer)
    texts = ["user\nWhat is this?", " leading space", "a  b   c\n\n", "图片里有一只橘色的猫。", "assistant\nIt is 42."]
    for text in texts:
        assert xc2.tokenizer(text, add_special_tokens=False)["input_ids"] == sp.encode(text)
        assert xc2.tokenizer(text)["input_ids"] == [1] + sp.encode(text)
        assert xc2.tokenizer.decode(sp.encode(text)) == text
    # the converter's output: no remote-code class names, the same ids
    src = xc2_official_directory(str(tmp_path / "official"))
    convert_official_tokenizer(src, str(tmp_path / "native"))
    with open(tmp_path / "native" / "tokenizer_config.json") as handle:
        assert "InternLMXComposer2Tokenizer" not in handle.read()
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "native")  # the weights' config, for the adapter
    native = build_adapter(ModelConfig(family="internlm_xcomposer2", path=str(tmp_path / "native"), image_size=490))
    assert isinstance(native.tokenizer, InternLM2Tokenizer)
    for text in texts:
        assert native.tokenizer(text, add_special_tokens=False)["input_ids"] == sp.encode(text)


# -- docs/collator.md shows one dialogue per family as the encoder renders it; regenerate the
# -- block with MMTUNE_UPDATE_DOCS=1 python -m pytest tests/models/test_golden_templates.py -k docs

DOC_RECORDS = {
    "llava": ("llava", {"id": "doc-llava", "image": "coco/000000215677.jpg", "conversations": [
        {"from": "human", "value": "What is he holding?\n<image>"}, {"from": "gpt", "value": "A red umbrella."},
        {"from": "human", "value": "Is it raining?"}, {"from": "gpt", "value": "Yes."}]}),
    "xc2": ("xcomposer2", {"id": "doc-xc2", "image": ["a.jpg", "b.jpg"], "conversations": [
        {"from": "user", "value": "Compare <ImageHere> and <ImageHere>. "}, {"from": "assistant", "value": "Both are dogs."},
        {"from": "user", "value": "Which is older?"}, {"from": "assistant", "value": "The first."}]}),
}  # fmt: skip
DOC_BEGIN, DOC_END = "<!-- rendered templates: begin -->", "<!-- rendered templates: end -->"


def _doc_block(llava, xc2):
    from mmtune.data.encoding import render_example

    lines = [DOC_BEGIN]
    for name, adapter, title in (("llava", llava, "LLaVA-1.5 (Vicuna v1, Llama-2 tokenizer)"),
                                 ("xc2", xc2, "InternLM-XComposer2 (InternLM2 tokenizer)")):  # fmt: skip
        fmt, record = DOC_RECORDS[name]
        example = encode_example(adapter, parse_record(fmt, record), max_length=None)
        lines += ["", f"{title}, `{fmt}` record:", "", "```json", json.dumps(record, ensure_ascii=False), "```", "",
                  "```text", render_example(example, adapter.tokenizer, adapter.image_token_id), "```"]  # fmt: skip
    return "\n".join(lines + ["", DOC_END])


def test_docs_show_the_rendered_templates(llava, xc2):
    path = os.path.join(REPO, "docs", "collator.md")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    block = _doc_block(llava, xc2)
    start, end = text.find(DOC_BEGIN), text.find(DOC_END)
    current = text[start : end + len(DOC_END)] if start >= 0 and end >= 0 else None
    if os.environ.get("MMTUNE_UPDATE_DOCS") == "1" and current != block:
        assert current is not None, f"add the markers {DOC_BEGIN} / {DOC_END} to {path}"
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text.replace(current, block))
        current = block
    assert current == block, "docs/collator.md is out of date: rerun with MMTUNE_UPDATE_DOCS=1"
