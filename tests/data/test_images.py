"""Image pipeline: processed-pixel cache, worker-side loading, corrupt-image handling."""

import os

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.collator import CollatorConfig, MultiImageDataset
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import ImageRef
from mmtune.data.images import CorruptImageError, ImagePipeline
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


@pytest.fixture()
def files(tmp_path):
    good = tmp_path / "good.jpg"
    PILImage.effect_noise((120, 80), 50).convert("RGB").save(good)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 this is not a jpeg")
    return str(good), str(bad)


@pytest.mark.parametrize("key", ["content", "stat"])
def test_cache_hit_returns_the_same_pixels(adapter, files, tmp_path, key):
    good, _ = files
    pipe = ImagePipeline(adapter, cache_dir=str(tmp_path / "cache"), key=key)
    first = pipe.load_one(good)
    assert pipe.stats.decoded == 1 and pipe.stats.cache_hits == 0
    again = ImagePipeline(adapter, cache_dir=str(tmp_path / "cache"), key=key)
    second = again.load_one(good)
    assert again.stats.decoded == 0 and again.stats.cache_hits == 1
    assert torch.equal(first, second)
    torch.testing.assert_close(first, adapter.preprocess_images([good])[0])
    stored = [f for _, _, fs in os.walk(tmp_path / "cache") for f in fs]
    assert len(stored) == 1 and stored[0].endswith(".px")


def test_cache_key_includes_processor_settings(files, tmp_path):
    good, _ = files
    pad = ImagePipeline(build_adapter(ModelConfig(family="llava")), cache_dir=str(tmp_path))
    resize = ImagePipeline(build_adapter(ModelConfig(family="llava", image_aspect_ratio="resize")), cache_dir=str(tmp_path))
    assert pad.settings_hash != resize.settings_hash
    assert not torch.equal(pad.load_one(good), resize.load_one(good))
    assert resize.stats.decoded == 1


def test_content_key_survives_a_copy(adapter, files, tmp_path):
    good, _ = files
    copy = tmp_path / "copy.jpg"
    copy.write_bytes(open(good, "rb").read())
    ImagePipeline(adapter, cache_dir=str(tmp_path / "c")).load_one(good)
    pipe = ImagePipeline(adapter, cache_dir=str(tmp_path / "c"))
    pipe.load_one(str(copy))
    assert pipe.stats.cache_hits == 1


def test_corrupt_image_strict_names_file_dialogue_and_turn(adapter, files):
    good, bad = files
    pipe = ImagePipeline(adapter)
    with pytest.raises(CorruptImageError, match=r"bad\.jpg.*dialogue 'd7', turn 2"):
        pipe.load([ImageRef(good, 0, 16), ImageRef(bad, 2, 16)], dialogue_id="d7")
    assert pipe.stats.corrupt == 1
    with pytest.raises(CorruptImageError, match="missing.jpg"):
        pipe.load_one("/missing.jpg")


def test_dataset_skip_mode_counts_and_drops(adapter, files):
    good, bad = files
    dialogues = [
        Dialogue("ok", "t", (Turn("user", (Image(good), "q")), Turn("assistant", ("a",)))),
        Dialogue("broken", "t", (Turn("user", ("q",)), Turn("assistant", ("a",)), Turn("user", (Image(bad), "q2")), Turn("assistant", ("b",)))),
    ]
    strict = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256))
    with pytest.raises(CorruptImageError, match="'broken', turn 2"):
        strict[1]
    lenient = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256, image_errors="skip"))
    batch = lenient.collator()([lenient[0], lenient[1]])
    assert lenient.skipped_corrupt == 1 and batch["input_ids"].shape[0] == 1


def test_images_are_decoded_in_dataloader_workers(adapter, files, tmp_path):
    """Pixels come from __getitem__, so with num_workers > 0 the main process decodes nothing."""
    good, _ = files
    dialogues = [Dialogue(f"d{i}", "t", (Turn("user", (Image(good), "q")), Turn("assistant", ("a",)))) for i in range(4)]
    dataset = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256, image_cache_dir=str(tmp_path / "px")))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=1, collate_fn=dataset.collator())
    batches = list(loader)
    assert sum(b["pixel_values"].shape[0] for b in batches) == 4
    assert dataset.images.stats.decoded == 0 and dataset.images.stats.cache_hits == 0  # main process untouched
    assert len([f for _, _, fs in os.walk(tmp_path / "px") for f in fs]) == 1  # the worker filled the cache


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_non_rgb_files_match_the_image_processor(adapter, tmp_path, mode):
    path = tmp_path / f"x_{mode}.png"
    PILImage.effect_noise((70, 40), 60).convert(mode).save(path)
    pixels = ImagePipeline(adapter).load_one(str(path))
    reference = adapter.image_processor(images=[PILImage.open(path).convert("RGB")], return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(pixels, reference, atol=1e-5, rtol=0)


# -- the qwen2_vl family: one cached array per image, shapes differ, finished per batch -------------


@pytest.fixture(scope="module")
def qwen():
    return build_adapter(ModelConfig(family="qwen2_vl"))


@pytest.fixture()
def odd_files(tmp_path):
    paths = []
    for k, (size, mode) in enumerate([((120, 80), "RGB"), ((30, 200), "L"), ((61, 61), "RGBA"), ((333, 90), "P")]):
        path = tmp_path / f"odd{k}.png"
        PILImage.effect_noise(size, 50).convert(mode).save(path)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("key", ["content", "stat"])
def test_qwen_images_of_different_shapes_cache_one_by_one_and_finish_as_the_processor(qwen, odd_files, tmp_path, key):
    pipe = ImagePipeline(qwen, cache_dir=str(tmp_path / "px"), key=key)
    first = pipe.load_images([ImageRef(p, 0, 0) for p in odd_files], dialogue_id="q")
    assert len({tuple(t.shape) for t in first}) == len(odd_files) and all(t.dtype == torch.uint8 for t in first)
    again = ImagePipeline(qwen, cache_dir=str(tmp_path / "px"), key=key)
    second = again.load_images([ImageRef(p, 0, 0) for p in odd_files], dialogue_id="q")
    assert pipe.stats.decoded == len(odd_files) and again.stats.cache_hits == len(odd_files) and again.stats.decoded == 0
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    expected = qwen.image_inputs(odd_files)  # transformers' image processor on the decoded files
    for inputs in (pipe.inputs(second), pipe.load_inputs([ImageRef(p, 0, 0) for p in odd_files])):
        assert set(inputs) == set(qwen.image_input_names)
        for name in qwen.image_input_names:
            assert torch.equal(inputs[name], expected[name]), name
    with pytest.raises(ValueError, match="not pixel_values alone: use ImagePipeline.inputs"):
        pipe.load([ImageRef(odd_files[0], 0, 0)])


def test_qwen_cache_key_follows_every_processor_setting(tmp_path):
    base = ImagePipeline(build_adapter(ModelConfig(family="qwen2_vl")), cache_dir=str(tmp_path)).settings_hash
    same = ImagePipeline(build_adapter(ModelConfig(family="qwen2_vl")), cache_dir=str(tmp_path)).settings_hash
    assert base == same
    keys = {base}
    for changed in ({"max_pixels": 28 * 28 * 16}, {"min_pixels": 28 * 28 * 8}):
        keys.add(ImagePipeline(build_adapter(ModelConfig(family="qwen2_vl", **changed)), cache_dir=str(tmp_path)).settings_hash)
    adapter = build_adapter(ModelConfig(family="qwen2_vl"))
    for name, value in (("resample", 2), ("do_convert_rgb", False), ("patch_size", 16)):
        setattr(adapter.image_processor, name, value)  # any setting of the processor, without a list of them
        keys.add(ImagePipeline(adapter, cache_dir=str(tmp_path)).settings_hash)
    assert len(keys) == 6


def _refused_image(tmp_path):
    path = tmp_path / "strip.png"
    PILImage.new("RGB", (4, 1000), (1, 2, 3)).save(path)  # aspect ratio 250: the Qwen-VL processor refuses it
    return str(path)


def test_an_image_the_processor_refuses_is_skipped_or_refused_per_the_image_policy(qwen, files, tmp_path):
    good, _ = files
    strip = _refused_image(tmp_path)
    dialogues = [
        Dialogue("ok", "t", (Turn("user", (Image(good), "q")), Turn("assistant", ("a",)))),
        Dialogue("strip", "t", (Turn("user", ("q",)), Turn("assistant", ("a",)), Turn("user", (Image(strip), "q2")),
                                Turn("assistant", ("b",)))),
    ]
    strict = MultiImageDataset(dialogues, qwen, CollatorConfig(max_length=256, image_errors="strict"))
    with pytest.raises(CorruptImageError, match=r"strip\.png.*'strip', turn 2.*aspect ratio"):
        strict[1]
    lenient = MultiImageDataset(dialogues, qwen, CollatorConfig(max_length=256, image_errors="skip"))
    skipped = lenient[1]
    assert skipped.reason == "unsupported_image" and "strip.png turn 2" in skipped.detail
    batch = lenient.collator()([lenient[0], skipped])
    assert lenient.skipped_corrupt == 1 and batch["input_ids"].shape[0] == 1


def test_the_length_pass_skips_or_refuses_an_image_the_processor_refuses(qwen, files, tmp_path):
    from mmtune.data.lengths import compute_lengths

    good, _ = files
    strip = _refused_image(tmp_path)
    dialogues = [Dialogue(f"d{i}", "src", (Turn("user", (Image(strip if i == 2 else good), "q")),
                                           Turn("assistant", ("a",)))) for i in range(4)]
    with pytest.raises(CorruptImageError, match=r"strip\.png.*'d2', turn 1 \(question\)"):
        compute_lengths(qwen, dialogues, max_length=256)
    table = compute_lengths(qwen, dialogues, max_length=256, image_errors="skip", cache_dir=str(tmp_path / "len"))
    assert table.lengths[2] == 0 and all(table.lengths[i] > 0 for i in (0, 1, 3))
    (item,) = table.image_skipped
    assert item["index"] == 2 and item["dialogue_id"] == "d2" and item["reason"] == "unsupported_image"
    cached = compute_lengths(qwen, dialogues, max_length=256, image_errors="skip", cache_dir=str(tmp_path / "len"))
    assert cached.from_cache and cached.image_skipped == table.image_skipped
    # a strict pass never reads the skip table from the cache
    with pytest.raises(CorruptImageError):
        compute_lengths(qwen, dialogues, max_length=256, cache_dir=str(tmp_path / "len"))


def test_named_arrays_round_trip_through_the_cache_file(tmp_path):
    import numpy as np

    from mmtune.data.images import _read, _serialise_any

    value = {"pixel_values": np.random.default_rng(0).random((2, 3, 4, 4), dtype=np.float32),
             "image_sizes": np.array([[30, 40]], dtype=np.int64), "pixel_attention_mask": np.ones((1, 4), bool)}
    path = tmp_path / "x.px"
    path.write_bytes(_serialise_any(value))
    back = _read(str(path))
    assert sorted(back) == sorted(value) and all(
        back[k].dtype == value[k].dtype and np.array_equal(back[k], value[k]) for k in value)
    path.write_bytes(_serialise_any(value)[:-3])  # a torn write is not a cached entry
    assert _read(str(path)) is None


class _HalfPrecisionAdapter:
    """The tiny LLaVA adapter with an image path that makes bfloat16 pixels and stores them as
    numpy, which has no bfloat16: Llama 4's case before mmtune kept the processor's dtype."""

    def __init__(self, adapter):
        self._adapter = adapter

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def load_image(self, path):
        return torch.from_numpy(self._adapter.load_image(path)).to(torch.bfloat16).numpy()


def test_a_conversion_failure_is_named_as_one_never_as_a_bad_file(adapter, files):
    from mmtune.core.images import ImageInputError

    good, bad = files
    failing = _HalfPrecisionAdapter(adapter)
    pipe = ImagePipeline(failing)
    with pytest.raises(ImageInputError, match=r"good\.jpg.*dialogue 'd3', turn 2.*decodes.*model 'llava"
                                              r".*TypeError.*BFloat16") as err:
        pipe.load([ImageRef(good, 2, 16)], dialogue_id="d3")
    assert not isinstance(err.value, CorruptImageError) and "Replace or remove" not in str(err.value)
    assert pipe.stats.corrupt == 0
    with pytest.raises(CorruptImageError, match=r"bad\.jpg"):  # a bad file stays a bad file
        pipe.load_one(bad)
    dialogues = [Dialogue("ok", "t", (Turn("user", (Image(good), "q")), Turn("assistant", ("a",))))]
    lenient = MultiImageDataset(dialogues, failing, CollatorConfig(max_length=256, image_errors="skip"))
    with pytest.raises(ImageInputError, match="'ok', turn 1"):  # skip mode does not drop every image sample
        lenient[0]
