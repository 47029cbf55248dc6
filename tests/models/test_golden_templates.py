"""Token-exact agreement with the official LLaVA-1.5 and InternLM-XComposer2 training code.

The golden vectors under ``<fixtures>/golden`` were produced by the official preprocessing
code on sample dialogues, with the real Llama-2 and InternLM2 tokenizers
(``<fixtures>/tokenizers``). Each case's native record goes through the normal path
(reader -> Dialogue -> adapter -> encoder); every image's run of image-token ids is
collapsed to one ``-200`` and the result must equal the official ``input_ids`` and
``labels`` token for token.

The fixtures folder is ``$MMTUNE_FIXTURES_DIR``, else ``../shared/fixtures`` next to the
repository. Without it these tests skip with a message, except under ``CI=true`` (as CI
systems set it), where they fail: a CI run must not pass by skipping them.
"""

import json
import os
import random
import re
import shutil

import pytest

from mmtune.data.encoding import encode_example, encode_examples
from mmtune.data.readers import parse_record
from mmtune.data.validation import check_dialogue
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE_MARKER = -200


def fixtures_dir() -> str:
    """``$MMTUNE_FIXTURES_DIR``, else ``../shared/fixtures`` next to the repository."""
    return os.path.abspath(os.environ.get("MMTUNE_FIXTURES_DIR") or os.path.join(REPO, "..", "shared", "fixtures"))


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def fixture_file(*parts: str) -> str:
    """The path of a fixture file; skips the test when the fixtures folder is missing
    (fails instead under ``CI=true``)."""
    root = fixtures_dir()
    if not os.path.isdir(os.path.join(root, "golden")):
        message = (
            f"golden template fixtures not found in {root}: set MMTUNE_FIXTURES_DIR to the fixtures folder "
            "(the one holding golden/ and tokenizers/), or place it at ../shared/fixtures next to the repository"
        )
        if _on_ci():
            pytest.fail(message + " (CI=true: a missing fixtures folder is an error, not a skip)", pytrace=False)
        pytest.skip(message)
    return os.path.join(root, *parts)


def _cases(name):
    """The golden cases of ``name`` as test parameters; one placeholder when the fixtures are
    missing, so that the test runs and :func:`fixture_file` skips or fails it."""
    path = os.path.join(fixtures_dir(), "golden", name)
    if not os.path.exists(path):
        return [pytest.param(None, id="fixtures-missing")]
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _case_id(case):
    return case["id"] if isinstance(case, dict) else None


def test_missing_fixtures_skip_locally_and_fail_on_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("MMTUNE_FIXTURES_DIR", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="MMTUNE_FIXTURES_DIR"):
        fixture_file("golden", "llava_v1.json")
    assert [p.id for p in _cases("llava_v1.json")] == ["fixtures-missing"]
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        fixture_file("golden", "llava_v1.json")
    (tmp_path / "golden").mkdir()
    assert fixture_file("tokenizers", "x.model") == str(tmp_path / "tokenizers" / "x.model")


@pytest.mark.slow  # a fresh interpreter: ~6 s of imports; the test above checks the same rule in-process
def test_the_golden_suite_fails_on_ci_without_fixtures(tmp_path):
    """End to end, as a CI job runs it: every selected golden test fails (none skips)."""
    import subprocess
    import sys

    env = {**os.environ, "CI": "true", "MMTUNE_FIXTURES_DIR": str(tmp_path / "absent")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
         "-k", "matches_the_official_preprocessing or agree_with_sentencepiece"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1]  # e.g. "3 failed, 11 deselected, 1 error in 5.9s"
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (failed|errors?|passed|skipped)", summary)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    assert run.returncode == 1 and failed == 4 and "passed" not in counts and "skipped" not in counts, run.stdout[-2000:]


def llava_checkpoint(directory):
    """A llava-hf style directory with the real Llama-2 tokenizer (``<image>`` = 32000)."""
    from transformers import AutoTokenizer, LlavaConfig, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from mmtune.models.llava import TINY_ARCHITECTURE

    source = os.path.join(directory, "source")
    os.makedirs(source)
    for name in ("tokenizer.model", "tokenizer.json"):
        shutil.copy(fixture_file("tokenizers", "llama2", name), source)
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
    shutil.copy(fixture_file("tokenizers", "internlm2", "tokenizer.model"), directory)
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
def llava_fast_only(tmp_path_factory):
    """The same checkpoint without ``tokenizer.model`` (what transformers 5 saves): only the
    fast tokenizer's ``tokenizer.json`` is there to encode with."""
    path = llava_checkpoint(str(tmp_path_factory.mktemp("llava-fast")))
    os.remove(os.path.join(path, "tokenizer.model"))
    return build_adapter(ModelConfig(family="llava", path=path))


@pytest.fixture(scope="module")
def xc2(tmp_path_factory):
    path = xc2_official_directory(str(tmp_path_factory.mktemp("xc2") / "official"))
    return build_adapter(ModelConfig(family="internlm_xcomposer2", path=path, internlm_xcomposer2={"image_size": 490}))


def collapse_images(ids, labels, image_token_id, per_image):
    """Each image's run of ``per_image`` copies of ``image_token_id`` -> one ``-200`` (every
    label in the run must be ignored); adjacent images make one run of several images."""
    out_ids, out_labels, k = [], [], 0
    while k < len(ids):
        if ids[k] == image_token_id:
            end = k
            while end < len(ids) and ids[end] == image_token_id:
                end += 1
            assert (end - k) % per_image == 0, f"an image run of {end - k} tokens at {k}, not a multiple of {per_image}"
            assert all(label == IGNORE_INDEX for label in labels[k:end]), f"labelled image positions at {k}"
            out_ids += [IMAGE_MARKER] * ((end - k) // per_image)
            out_labels += [IGNORE_INDEX] * ((end - k) // per_image)
            k = end
        else:
            out_ids.append(ids[k])
            out_labels.append(labels[k])
            k += 1
    return out_ids, out_labels


def collapse_example(adapter, example):
    """An encoded example's ids and labels with each image as one ``-200``."""
    ids, labels = collapse_images(example.input_ids, example.labels, adapter.image_token_id, adapter.num_image_tokens)
    assert ids.count(IMAGE_MARKER) == sum(1 for _ in example.images)
    return ids, labels


def encode_case(adapter, case):
    dialogue = parse_record(case["native_format"], case["native_record"])
    return collapse_example(adapter, encode_example(adapter, dialogue, max_length=None))


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


LLAVA_TOKENIZERS = ("llava", "llava_fast_only")  # with tokenizer.model / with tokenizer.json alone


@pytest.mark.parametrize("which", LLAVA_TOKENIZERS)
@pytest.mark.parametrize("case", _cases("llava_v1.json"), ids=_case_id)
def test_llava_v1_matches_the_official_preprocessing(request, which, case):
    llava = request.getfixturevalue(which)
    ids, labels = encode_case(llava, case)
    assert_same(llava, case, ids, case["input_ids"], "input_ids", "<image>")
    assert_same(llava, case, labels, case["labels"], "labels", "<image>")


@pytest.mark.parametrize("case", _cases("xc2.json"), ids=_case_id)
def test_xcomposer2_matches_the_official_preprocessing(xc2, case):
    ids, labels = encode_case(xc2, case)
    assert_same(xc2, case, ids, case["input_ids"], "input_ids", "<ImageHere>")
    assert_same(xc2, case, labels, case["labels"], "labels", "<ImageHere>")


def test_golden_tokens_agree_with_sentencepiece():
    """The fixtures themselves: the official ``tokens`` are the SentencePiece pieces of the ids."""
    import sentencepiece as spm

    for name, model in (("llava_v1.json", "llama2"), ("xc2.json", "internlm2")):
        sp = spm.SentencePieceProcessor(model_file=fixture_file("tokenizers", model, "tokenizer.model"))
        for case in _cases(name):
            pieces = [sp.id_to_piece(i) if i >= 0 else None for i in case["input_ids"]]
            assert [p for p in pieces if p] == [t for t, i in zip(case["tokens"], case["input_ids"]) if i >= 0]


# -- a second, independent statement of the official LLaVA-1.5 preprocessing, for dialogues
# -- that have no golden vector (haotian-liu/LLaVA @ c121f04: conversation.py conv_vicuna_v1,
# -- mm_utils.py tokenizer_image_token, train/train.py preprocess_multimodal / preprocess_v1;
# -- MMDU's fork Liuziyu77/MMDU @ 98a1a39 skips preprocess_multimodal for image lists), each
# -- step written out with SentencePiece itself.

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
BOS, UNK = 1, 0
# the added tokens of the slow Llama tokenizer: tokenize() splits them out of the text first
_SPECIAL = re.compile("(<unk>|<s>|</s>)")


def _slow_llama(sp, text):
    """``tokenizer(text).input_ids`` of the slow ``LlamaTokenizer`` with ``legacy=True``
    (transformers 4.37): BOS, then every part between special tokens encoded by one
    SentencePiece call, which starts it with the dummy-prefix word marker."""
    ids = [BOS]
    for part in _SPECIAL.split(text):
        if _SPECIAL.fullmatch(part):
            ids.append(sp.piece_to_id(part))
        elif part:
            ids.extend(sp.encode(part))
    return ids


def _tokenizer_image_token(sp, prompt):
    """Each ``<image>``-separated chunk tokenized alone (with its BOS), the first chunk's BOS
    kept once, every chunk's dropped, ``-200`` between chunks."""
    chunks = [_slow_llama(sp, chunk) for chunk in prompt.split("<image>")]
    ids = [BOS]
    for k, chunk in enumerate(chunks):
        if k:
            ids.append(IMAGE_MARKER)
        ids.extend(chunk[1:])
    return ids


def _vicuna_v1_prompt(system, messages):
    """``conv_vicuna_v1.get_prompt()``: sep " " after user turns, sep2 "</s>" after answers;
    an empty message adds only ``ROLE:``."""
    prompt = system + " "
    for k, (role, message) in enumerate(messages):
        prompt += f"{role}: {message}{' ' if k % 2 == 0 else '</s>'}" if message else f"{role}:"
    return prompt


def official_llava(sp, fmt, record, system=VICUNA_SYSTEM):
    """The official ``input_ids`` / ``labels`` of a ``llava`` or ``mmdu`` record.

    ``system``: the template's system prompt (a leading system turn of the record replaces
    it: mmtune's system turn stands for the template's system string).
    """
    turns = list(record["conversations"])
    if turns and turns[0]["from"] == "system":
        system, turns = turns[0]["value"], turns[1:]
    values = [t["value"] for t in turns]
    if fmt == "mmdu":  # roles and placeholder as the fork's preprocess_v1 knows them
        values = [v.replace("<ImageHere>", "<image>") for v in values]
    elif isinstance(record.get("image"), str):
        # preprocess_multimodal: the image moves to the front of its turn, which is stripped
        values = [("<image>\n" + v.replace("<image>", "").strip()).strip() if "<image>" in v else v for v in values]
    has_image = "image" in record
    messages = [("USER" if k % 2 == 0 else "ASSISTANT", v) for k, v in enumerate(values)]
    prompt = _vicuna_v1_prompt(system, messages)
    tokenize = _tokenizer_image_token if has_image else _slow_llama
    ids = tokenize(sp, prompt)
    assert len(ids) < 2048, "keep generated dialogues under model_max_length (the text-only path truncates there)"
    # preprocess_v1's masking: rounds split at sep2; a round is len(tokenize(round)) long
    # (its BOS stands for the </s> the split removed), its instruction part
    # len(tokenize(part + " ASSISTANT: ")) - 2 (no BOS, no lone marker of the trailing
    # space); legacy=True, so no per-round correction.
    labels = list(ids)
    labels[:1] = [IGNORE_INDEX]
    cur = 1
    for rou in prompt.split("</s>"):
        if rou == "":
            break
        parts = rou.split(" ASSISTANT: ")
        if len(parts) != 2:
            break
        instruction_len = len(tokenize(sp, parts[0] + " ASSISTANT: ")) - 2
        labels[cur : cur + instruction_len] = [IGNORE_INDEX] * len(labels[cur : cur + instruction_len])
        cur += len(tokenize(sp, rou))
    labels[cur:] = [IGNORE_INDEX] * len(labels[cur:])
    if cur != sum(1 for t in ids if t != UNK):  # "WARNING: tokenization mismatch": nothing is learnt
        labels = [IGNORE_INDEX] * len(ids)
    return ids, labels


# -- generated dialogues: every common start of the text right after an image

_WORDS = (
    "the and with of to a in is for on that this which or but as at by from it what how not "
    "image picture photo left right first second both one two vs"
).split()
_HEADS = (
    *_WORDS, *(w.capitalize() for w in _WORDS), *(w.upper() for w in _WORDS[:6]),
    *". , ; : ! ? ) ( - ' \" ... / [ ] * # & % 's".split(), "1", "42", "1889", "日本", "é", "\u2581", "<",
)  # fmt: skip
_LEADS = ("", " ", "  ", "   ", "\n", "\n\n", " \n", "\n ", "\t", " \t ")
#: every start of the text after an image the generator covers (each used at least once)
AFTER_IMAGE = tuple(lead + head for lead in _LEADS for head in _HEADS)
_TRAILS = ("", "", " ", "  ", "\n", " \n", "\n\n", "\t")


def _phrase(rng, words=None):
    out = ""
    for _ in range(rng.randint(0, 5) if words is None else words):
        out += (rng.choice(("", " ", " ", " ", "  ", "\n")) if out else "") + rng.choice(_HEADS)
    return out


def _answer(rng):
    return rng.choice(_LEADS) + rng.choice(_WORDS) + _phrase(rng) + rng.choice(_TRAILS)


def generated_llava_records(count=400, seed=0):
    """``(format, record, system_prompt)`` triples in LLaVA-1.5's two shapes: ``mmdu``
    (two or more images anywhere in user turns, up to three per turn, adjacent ones too;
    placeholders stay; text-only records) and ``llava`` (one image at any place of any user
    turn, moved to the front; text-only records), 1-4 exchanges, whitespace around turns,
    system turns and system prompts. Generation runs until every :data:`AFTER_IMAGE` start
    was used once."""
    rng = random.Random(seed)
    starts = list(AFTER_IMAGE)
    rng.shuffle(starts)

    def after_image():
        if rng.random() < 0.15:
            return ""  # image at the end of the turn, or right before the next image
        return (starts.pop() if starts else rng.choice(AFTER_IMAGE)) + _phrase(rng) + rng.choice(_TRAILS)

    def user_turn(images, marker):
        text = rng.choice(_LEADS) + _phrase(rng) + rng.choice(_TRAILS) if rng.random() < 0.8 else ""
        for _ in range(images):
            text += marker + after_image()
        return text if text.strip() else text + rng.choice(_WORDS)  # validation drops blank turns

    systems = (None, None, None, "", "You are a careful visual assistant.", "Answer briefly. ", " Be exact.\n")
    out = []
    while len(out) < count or starts:
        n = len(out)
        fmt = "mmdu" if n % 3 else "llava"
        exchanges = rng.randint(1, 4)
        if fmt == "mmdu":
            per_turn = [rng.choice((0, 1, 1, 2, 3)) for _ in range(exchanges)]
            if n % 9 == 1:
                per_turn = [0] * exchanges  # text-only record
            elif sum(per_turn) < 2:  # the fork has no branch for a one-image list
                per_turn[rng.randrange(exchanges)] += 2 - sum(per_turn)
            roles, marker = ("user", "assistant"), "<ImageHere>"
        else:
            per_turn = [0] * exchanges
            if n % 6:  # else text-only
                per_turn[rng.randrange(exchanges)] = 1
            roles, marker = ("human", "gpt"), "<image>"
        conversations = []
        for k in per_turn:
            conversations += [{"from": roles[0], "value": user_turn(k, marker)}, {"from": roles[1], "value": _answer(rng)}]
        if rng.random() < 0.1:
            conversations.insert(0, {"from": "system", "value": rng.choice(systems[4:])})
        record = {"id": f"{fmt}-{n}", "conversations": conversations}
        if sum(per_turn):
            record["image"] = "p.jpg" if fmt == "llava" else [f"p{k}.jpg" for k in range(sum(per_turn))]
        out.append((fmt, record, rng.choice(systems)))
    return out


def test_generated_dialogues_cover_every_start_after_an_image():
    records = generated_llava_records()
    seen = set()
    for fmt, record, _ in records:
        marker = "<ImageHere>" if fmt == "mmdu" else "<image>"
        for turn in record["conversations"]:
            for after in turn["value"].split(marker)[1:]:
                seen.update(start for start in AFTER_IMAGE if after.startswith(start))
    assert seen == set(AFTER_IMAGE)
    assert len(records) >= 400
    assert {fmt for fmt, _, _ in records} == {"mmdu", "llava"}
    shapes = {(fmt, "image" in record) for fmt, record, _ in records}
    assert shapes == {("mmdu", True), ("mmdu", False), ("llava", True), ("llava", False)}


@pytest.mark.parametrize("which", LLAVA_TOKENIZERS)
def test_llava_v1_agrees_with_the_official_rules_on_generated_dialogues(request, which):
    """Hundreds of generated dialogues, encoded the training way (one batched call per
    system prompt) and measured by the length pass, against :func:`official_llava`."""
    import sentencepiece as spm

    llava = request.getfixturevalue(which)
    sp = spm.SentencePieceProcessor(model_file=fixture_file("tokenizers", "llama2", "tokenizer.model"))
    records = generated_llava_records()
    groups: dict = {}
    for fmt, record, system in records:
        dialogue = parse_record(fmt, record)
        assert check_dialogue(dialogue, 0) == [], record  # only what the data checks let through
        groups.setdefault(system, []).append((fmt, record, dialogue))
    checked = 0
    for system, members in groups.items():
        dialogues = [d for _, _, d in members]
        examples = encode_examples(llava, dialogues, max_length=None, system_prompt=system)
        lengths = llava.measure_many(dialogues, system_prompt=system)
        for (fmt, record, _), example, (fixed, turns, _, _) in zip(members, examples, lengths):
            want_ids, want_labels = official_llava(sp, fmt, record, VICUNA_SYSTEM if system is None else system)
            assert any(label != IGNORE_INDEX for label in want_labels), record["id"]  # no masked-out sample
            ids, labels = collapse_example(llava, example)
            case = {"id": f"{record['id']} {json.dumps(record, ensure_ascii=False)}", "input_ids": want_ids}
            assert_same(llava, case, ids, want_ids, "input_ids", "<image>")
            assert_same(llava, case, labels, want_labels, "labels", "<image>")
            assert fixed + sum(turns) == len(example.input_ids)  # the length pass counts what is encoded
            checked += 1
    assert checked == len(records)


def test_sentencepiece_rebuilt_from_tokenizer_json_encodes_as_tokenizer_model(llava_fast_only):
    """The SentencePiece model the adapter rebuilds from ``tokenizer.json`` alone gives the
    ids of the original ``tokenizer.model``: on generated text full of whitespace runs and
    on real prose and code (this repository's sources and docs)."""
    import glob

    import sentencepiece as spm

    real = spm.SentencePieceProcessor(model_file=fixture_file("tokenizers", "llama2", "tokenizer.model"))
    rebuilt = llava_fast_only._sp
    assert llava_fast_only._sp_path is None and rebuilt is not None
    assert [rebuilt.id_to_piece(i) for i in range(real.get_piece_size())] == [
        real.id_to_piece(i) for i in range(real.get_piece_size())
    ]
    rng = random.Random(0)
    alphabet = [*_HEADS, *_LEADS, " " * 17, " " * 40, "ÄöüßçñЖあア한😀\u3000\u00a0\r", "    return x\n"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(20000)]
    for path in sorted(glob.glob(os.path.join(REPO, "src", "mmtune", "**", "*.py"), recursive=True)) + sorted(
        glob.glob(os.path.join(REPO, "docs", "*.md"))
    ):
        with open(path, encoding="utf-8") as handle:
            texts += handle.read().split("\n\n")
    got, want = rebuilt.encode(texts), real.encode(texts)
    wrong = [text for text, a, b in zip(texts, got, want) if a != b]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ, e.g. {wrong[:3]}"


def test_sentencepiece_rebuild_reads_older_conversions_and_refuses_unordered_ones():
    """A ``tokenizer.json`` as transformers 4.x converted Llama (``Prepend`` + ``Replace``
    normalizer, merges as strings ordered by score: whitespace-only ones last) rebuilds the
    same model; one whose merges do not follow the vocabulary order cannot be rebuilt."""
    import sentencepiece as spm
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mmtune.models._utils import sentencepiece_from_fast_tokenizer

    with open(fixture_file("tokenizers", "llama2", "tokenizer.json"), encoding="utf-8") as handle:
        state = json.load(handle)
    merges = [" ".join(m) for m in state["model"]["merges"]]
    spaces_only = [m for m in merges if set(m) == {" ", "\u2581"}]
    older = {
        **state,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "model": {**state["model"], "merges": [m for m in merges if m not in spaces_only] + spaces_only},
    }  # fmt: skip

    def wrap(tokenizer_state):
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(tokenizer_state)), unk_token="<unk>")

    real = spm.SentencePieceProcessor(model_file=fixture_file("tokenizers", "llama2", "tokenizer.model"))
    rebuilt = sentencepiece_from_fast_tokenizer(wrap(older))
    texts = [" and", "a  b", "x    return", "  \n\t and ▁ é日本", "USER: <image>  Look"]
    assert rebuilt is not None and rebuilt.encode(texts) == real.encode(texts)
    shuffled = {**state, "model": {**state["model"], "merges": state["model"]["merges"][::-1]}}
    assert sentencepiece_from_fast_tokenizer(wrap(shuffled)) is None


# -- random dialogues for XComposer2 (its own rules below)

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
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=fixture_file("tokenizers", "internlm2", "tokenizer.model"))
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
    adapter = build_adapter(ModelConfig(family="internlm_xcomposer2", path=path,
                                        internlm_xcomposer2={"image_size": 490, "label_final_eos": False}))
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


# two or more spaces before a word: the fast (Rust) Llama tokenizer joins such spaces before
# the word's own merges, SentencePiece after them ("a  b": ▁a ▁▁ b against ▁a ▁ ▁b)
_SPACE_RUN = re.compile("[ \u2581]{2,}[^\\s\u2581]")


def test_saved_llava_chat_template_gives_the_training_ids(llava, tmp_path):
    """A saved checkpoint's chat template, applied by plain transformers to the real Llama
    tokenizer, reproduces the training ids (one ``<image>`` id per image) for every prompt
    without a run of spaces before a word (docs/collator.md states that limit; some
    generated prompts with such runs do differ)."""
    from transformers import AutoTokenizer

    llava.save_pretrained(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    cases = [(c["id"], c["native_format"], c["native_record"], None) for c in _cases("llava_v1.json")]
    for fmt, record, system in generated_llava_records():
        cases.append((record["id"], fmt, record, system))
        # the same dialogue inside the limit: single spaces, none at the ends of a turn or
        # right after a placeholder
        marker = "<ImageHere>" if fmt == "mmdu" else "<image>"
        tame = [
            {**t, "value": re.sub(" +", " ", t["value"]).replace(marker + " ", marker).strip(" ")}
            for t in record["conversations"]
        ]
        cases.append((record["id"] + "-single-spaces", fmt, {**record, "conversations": tame}, system))
    checked = differ = 0
    for rid, fmt, record, system in cases:
        dialogue = parse_record(fmt, record)
        want, _ = collapse_example(llava, encode_example(llava, dialogue, max_length=None, system_prompt=system))
        want = [llava.image_token_id if t == IMAGE_MARKER else t for t in want]
        messages = _messages(dialogue)
        if system is not None and dialogue.turns[0].role != "system":
            messages = [{"role": "system", "content": system}] + messages
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        got = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if _SPACE_RUN.search(rendered):
            differ += got != want
            continue
        assert_same(llava, {"id": rid, "input_ids": want}, got, want, "chat-template ids", "<image>")
        checked += 1
    assert checked >= 200 and differ > 0


def test_official_tokenizer_loads_without_remote_code_and_encodes_as_sentencepiece(xc2, tmp_path):
    import sentencepiece as spm

    from mmtune.models.internlm_xcomposer2 import InternLM2Tokenizer, convert_official_tokenizer

    sp = spm.SentencePieceProcessor(model_file=fixture_file("tokenizers", "internlm2", "tokenizer.model"))
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
    native = build_adapter(ModelConfig(family="internlm_xcomposer2", path=str(tmp_path / "native"),
                                        internlm_xcomposer2={"image_size": 490}))
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
