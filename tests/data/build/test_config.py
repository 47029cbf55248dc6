import pytest
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from mmtune.data.build.config import load_build_config
from mmtune.data.config import ConfigError


def test_shipped_configs_load_and_overrides_apply():
    cfg = load_build_config("demo", ["cluster.threshold=0.8", "output.dir=/tmp/x"])
    assert cfg.cluster.threshold == 0.8 and cfg.output.dir == "/tmp/x" and cfg.sets.max_images == 3
    assert load_build_config("wikipedia_like").sets.max_images == 5


def test_unknown_key_fails(tmp_path):
    with pytest.raises((ConfigAttributeError, ConfigKeyError), match="nope"):
        load_build_config("demo", ["cluster.nope=1"])
    path = tmp_path / "b.yaml"
    path.write_text("corpus: {path: c.jsonl}\nteacher: {modle: gpt}\noutput: {dir: o}\n")
    with pytest.raises((ConfigAttributeError, ConfigKeyError), match="modle"):
        load_build_config(str(path))


def test_every_semantic_problem_is_listed_once():
    with pytest.raises(ConfigError) as err:
        load_build_config("demo", ["cluster.threshold=1.5", "sets.min_images=4", "sets.max_images=2",
                                   "embed.kind=word2vec", "prompts.per_image=/no/such.txt"])
    text = str(err.value)
    for key in ("cluster.threshold", "sets.max_images", "embed.kind", "prompts.per_image"):
        assert key in text


def test_unknown_config_name_lists_the_available_ones():
    with pytest.raises(FileNotFoundError, match="demo"):
        load_build_config("no_such_build")
