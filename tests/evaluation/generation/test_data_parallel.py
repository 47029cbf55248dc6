"""Data-parallel generation, with ranks as threads of this process (the multi-process runs
are in test_data_parallel_processes.py, behind the slow marker): the split is balanced and
covers every dialogue once, the gathered file is byte for byte the one-process file, a
failing rank stops every rank and merges nothing, and every rank resumes after a kill."""

import itertools
import json
import random
import threading

import pytest

from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues
from mmtune.evaluation.config import GenerationConfig
from mmtune.evaluation.generation.data_parallel import (
    Layout,
    RankFailed,
    generate_shared,
    shard_files,
    shard_path,
    split_by_tokens,
)
from mmtune.evaluation.generation.generator import DialogueGenerator, StaleGenerationsError
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter

RUN_KEY = {"checkpoint": "tiny", "data": "held-out", "about": {"run": "test"}}


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_split_covers_every_item_once_and_is_balanced(world_size):
    rng = random.Random(world_size)
    for _ in range(200):
        weights = [rng.randint(1, 1000) for _ in range(rng.randint(0, 40))]
        shares = split_by_tokens(weights, world_size)
        assert len(shares) == world_size
        assert sorted(i for s in shares for i in s) == list(range(len(weights)))
        assert all(s == sorted(s) for s in shares)
        assert split_by_tokens(weights, world_size) == shares  # every rank computes the same split
        loads = [sum(weights[i] for i in s) for s in shares]
        # greedy onto the least loaded rank: the largest share is within one item of the mean
        if weights:
            assert max(loads) <= sum(weights) / world_size + max(weights)


def test_split_is_within_four_thirds_of_the_best_split():
    rng = random.Random(0)
    for _ in range(150):
        weights = [rng.randint(1, 50) for _ in range(rng.randint(1, 8))]
        for world_size in (2, 3):
            best = min(max(sum(w for w, r in zip(weights, deal) if r == rank) for rank in range(world_size))
                       for deal in itertools.product(range(world_size), repeat=len(weights)))
            got = max(sum(weights[i] for i in s) for s in split_by_tokens(weights, world_size))
            assert got <= 4 / 3 * best + 1e-9


class Threads:
    """``n`` ranks as threads: an all-gather through shared slots and a barrier."""

    def __init__(self, n):
        self.n, self.slots, self._barrier = n, [None] * n, threading.Barrier(n, timeout=120)

    def layout(self, rank):
        def exchange(obj):
            self.slots[rank] = obj
            self._barrier.wait()
            gathered = list(self.slots)
            self._barrier.wait()  # nobody writes the next round before everyone has read this one
            return gathered

        return Layout(rank, self.n, exchange=exchange, barrier=self._barrier.wait)

    def run(self, work):
        """``work(rank, layout)`` on every rank; per rank its result or the exception it raised."""
        out = [None] * self.n

        def main(rank):
            try:
                out[rank] = work(rank, self.layout(rank))
            except Exception as err:  # noqa: BLE001 - the test looks at what each rank raised
                out[rank] = err

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    adapter = build_adapter(ModelConfig(family="llava"))
    data = generate_synthetic(tmp_path_factory.mktemp("syn"), n_train=0, n_test=4, n_llava=0, image_size=32,
                              max_turns=3, seed=3)
    return adapter, adapter.load_model(seed=0), load_mmdu_dialogues(data.test_json, image_root=str(data.image_dir))


CFG = GenerationConfig(max_new_tokens=4, batch_size=2, device="cpu")


def _one_process(tiny, out):
    adapter, model, dialogues = tiny
    records, ranks = generate_shared(DialogueGenerator(adapter, model, CFG), dialogues, out, layout=Layout(),
                                     run_key=RUN_KEY)
    assert ranks is None
    return records


def _without_work(path):
    return [{k: v for k, v in json.loads(line).items() if k != "forward_tokens"} for line in path.open()]


def test_two_ranks_write_the_file_one_process_writes(tiny, tmp_path):
    adapter, model, dialogues = tiny
    single = _one_process(tiny, tmp_path / "one" / "synthetic.jsonl")
    out = tmp_path / "two" / "synthetic.jsonl"
    generators = [DialogueGenerator(adapter, model, CFG) for _ in range(2)]
    results = Threads(2).run(lambda r, layout: generate_shared(generators[r], dialogues, out, layout=layout,
                                                               run_key=RUN_KEY))
    assert not any(isinstance(r, Exception) for r in results), results
    (records0, ranks0), (records1, ranks1) = results
    assert out.read_bytes() == (tmp_path / "one" / "synthetic.jsonl").read_bytes()
    assert [r.answer for r in records0] == [r.answer for r in records1] == [r.answer for r in single]
    assert (out.parent / "synthetic.settings.json").read_text() == (tmp_path / "one" / "synthetic.settings.json").read_text()
    assert shard_files(out) == [] and not list(out.parent.glob("*.rank*"))
    # both ranks worked, on disjoint shares that cover every dialogue and turn
    assert ranks0 == ranks1 and [w["rank"] for w in ranks0] == [0, 1]
    assert all(w["dialogues"] > 0 and w["turns"] > 0 for w in ranks0)
    assert sum(w["dialogues"] for w in ranks0) == len(dialogues)
    assert sum(w["turns"] for w in ranks0) == len(single) == sum(g.stats["turns"] for g in generators)


def test_a_failing_rank_stops_every_rank_merges_nothing_and_the_rerun_resumes(tiny, tmp_path):
    adapter, model, dialogues = tiny
    single = _one_process(tiny, tmp_path / "one" / "synthetic.jsonl")
    out = tmp_path / "two" / "synthetic.jsonl"

    class Crashing(DialogueGenerator):
        """Dies after its second finished turn (like a process killed mid-share)."""

        def _records_for(self, *args, **kwargs):
            if self.stats["turns"] == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super()._records_for(*args, **kwargs)

    generators = [DialogueGenerator(adapter, model, CFG), Crashing(adapter, model, CFG)]
    results = Threads(2).run(lambda r, layout: generate_shared(generators[r], dialogues, out, layout=layout,
                                                               run_key=RUN_KEY))
    assert all(isinstance(r, RankFailed) and r.rank == 1 for r in results), results
    assert "rank 1 of 2 failed while generating synthetic" in str(results[0]) and "illegal memory" in str(results[0])
    assert not out.exists()  # no partial merge
    kept = shard_path(out, 1, 2)
    assert len(kept.read_text().splitlines()) == 2

    again = [DialogueGenerator(adapter, model, CFG) for _ in range(2)]
    results = Threads(2).run(lambda r, layout: generate_shared(again[r], dialogues, out, layout=layout,
                                                               run_key=RUN_KEY))
    assert not any(isinstance(r, Exception) for r in results), results
    # the same records; only forward_tokens (work done in this run) differs where a resumed
    # dialogue's history was fed again
    assert _without_work(out) == _without_work(tmp_path / "one" / "synthetic.jsonl")
    # rank 0 finished its share before: nothing again; rank 1 only what it had not finished
    assert again[0].stats["turns"] == 0
    assert again[1].stats["turns"] == results[0][1][1]["turns"] == sum(1 for _ in single) - generators[0].stats["turns"] - 2


def test_stale_answers_stop_every_rank_with_the_file_to_move(tiny, tmp_path):
    adapter, model, dialogues = tiny
    out = tmp_path / "synthetic.jsonl"
    other = adapter.load_model(seed=1)
    _one_process((adapter, other, dialogues), out)
    generators = [DialogueGenerator(adapter, model, CFG) for _ in range(2)]
    results = Threads(2).run(lambda r, layout: generate_shared(generators[r], dialogues, out, layout=layout,
                                                               run_key=RUN_KEY))
    assert all(isinstance(r, StaleGenerationsError) and r.path == out for r in results), results
    assert "['weights']" in str(results[1])


def test_one_process_takes_over_the_shares_of_a_killed_launch(tiny, tmp_path):
    adapter, model, dialogues = tiny
    single = _one_process(tiny, tmp_path / "one" / "synthetic.jsonl")
    out = tmp_path / "resumed" / "synthetic.jsonl"
    # three ranks had each answered their share's first turns when the job was killed
    shares = split_by_tokens([DialogueGenerator(adapter, model, CFG).expected_tokens(d) for d in dialogues], 3)
    lines = (tmp_path / "one" / "synthetic.jsonl").read_text().splitlines()
    for rank, share in enumerate(shares):
        ids = {dialogues[i].id for i in share}
        mine = [line for line in lines if json.loads(line)["dialogue_id"] in ids and json.loads(line)["turn"] == 0]
        path = shard_path(out, rank, 3)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in mine))
        path.with_suffix(".settings.json").write_text((tmp_path / "one" / "synthetic.settings.json").read_text())
    generator = DialogueGenerator(adapter, model, CFG)
    records, _ = generate_shared(generator, dialogues, out, layout=Layout(), run_key=RUN_KEY)
    assert generator.stats["turns"] == len(single) - len(dialogues)  # first turns were not asked again
    assert _without_work(out) == _without_work(tmp_path / "one" / "synthetic.jsonl")
    assert shard_files(out) == []
