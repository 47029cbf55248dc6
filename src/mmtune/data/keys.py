"""The unique key of every training record, and what repeats in a source.

Public instruction sets name records by their image: llava-665k's COCO records carry the
image's number as ``id`` (``"000000033471"``), and several conversations ask about one
image (LLaVA-Instruct's conversation, detail and reasoning sets, several VQA sets), so one
id names several records. LLaVA's own training never looks at ``id``; neither does
mmtune's training: every record is kept and trained. Where mmtune needs to tell records
apart (the Arrow cache, the batch plan, ``sample_ids.jsonl``, a resume, the length cache)
it uses the record's *key*: its id where no earlier record of the source has that id, else
``<id>@<position>`` (the record's 0-based position in its file, as reports number it
``#<position>``). So a file without repeated ids keeps its ids as keys.

An *exact duplicate* (same id, same images, same conversation) is kept too, as it is part
of the published data; ``data.validation.drop_exact_duplicates`` drops it, counted in the
report. Benchmarks, where an id names a result row, still refuse repeated ids
(:func:`mmtune.data.readers.read_source`, ``load_source(unique_ids=True)``).

Example::

    keys = RecordKeys()
    keys.add(dialogue_a, 0)   # ("000000033471", False)
    keys.add(dialogue_b, 5)   # ("000000033471@5", False): same id, other conversation
    keys.add(dialogue_b, 9)   # ("000000033471@9", True): same id, images and conversation
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import pyarrow as pa

    from mmtune.core.dialogue import Dialogue

__all__ = ["RecordKeys", "content_hash", "keys_in_file_order", "record_key"]


def record_key(dialogue: "Dialogue") -> str:
    """The unique key of a dialogue read from a source's cache (its id when it has none:
    dialogues built in memory, whose ids are their keys)."""
    return dialogue.meta.get("key", dialogue.id)


def content_hash(dialogue: "Dialogue") -> int:
    """The 64-bit hash exact duplicates are compared by: of (id, turns)."""
    return hash((dialogue.id, dialogue.turns))


class RecordKeys:
    """Gives a source's records unique keys, in file order, and counts what repeats.

    Holds one entry per key and one 64-bit content hash per record (tens of MB for
    llava-665k's 665,298 records); exact duplicates are compared by the hash of (id, turns),
    among records of one id only, so a hash collision would need two different records
    sharing an id and a 64-bit hash.
    """

    def __init__(self, max_examples: int = 5):
        self._first: dict[str, int] = {}
        """key -> position of the record that holds it (for ids: the first record of that id)."""
        self._contents: set[int] = set()
        self.max_examples = max_examples
        self.repeated = 0
        """Records whose id an earlier record has."""
        self.exact = 0
        """Records equal to an earlier one: same id, images and conversation."""
        self.examples: list[str] = []

    def add(self, dialogue: "Dialogue", position: int) -> tuple[str, bool]:
        """``(key, exact_duplicate)`` of the record at ``position`` of the file."""
        return self.add_content(dialogue.id, content_hash(dialogue), position)

    def add_content(self, rid: str, content: int, position: int) -> tuple[str, bool]:
        """:meth:`add` of a record known by its id and :func:`content_hash` (records read on
        other processes: the hash is Python's, the same in processes forked from one)."""
        exact = content in self._contents
        self._contents.add(content)
        first = self._first.get(rid)
        if first is None:
            self._first[rid] = position
            return rid, False
        self.repeated += 1
        self.exact += exact
        if len(self.examples) < self.max_examples:
            same = "the same conversation" if exact else "another conversation"
            self.examples.append(f"{rid!r} at #{first} and #{position} ({same})")
        key = f"{rid}@{position}"
        while key in self._first:  # a literal id of that form came earlier
            key = f"{key}@{position}"
        self._first[key] = position
        return key, exact


def keys_in_file_order(ids: "list[str] | pa.Array", contents: "np.ndarray", positions: "np.ndarray",
                       max_examples: int = 5) -> tuple["pa.Array", int, int, list[str]]:
    """What :class:`RecordKeys` gives records added in file order (their ids, content hashes and
    positions), computed on whole arrays: ``(keys, repeated, exact, examples)``. For millions
    of records read by several processes (:mod:`mmtune.data.parallel_read`); ids holding ``@``
    (which a generated key could equal) go through :class:`RecordKeys` itself."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    names = ids if isinstance(ids, pa.Array) else pa.array(ids, pa.string())
    if len(names) and pc.any(pc.match_substring(names, "@")).as_py():
        keys = RecordKeys(max_examples)
        found = [keys.add_content(rid, int(c), int(p))[0] for rid, c, p in zip(names.to_pylist(), contents, positions)]
        return pa.array(found, pa.string()), keys.repeated, keys.exact, keys.examples
    n = len(names)
    codes = names.dictionary_encode().indices.to_numpy(zero_copy_only=False).astype(np.int64)
    unique, first = np.unique(codes, return_index=True)
    repeat = np.ones(n, dtype=bool)
    repeat[first] = False
    # an exact duplicate: the id and content hash of an earlier record
    by_content = np.lexsort((np.arange(n), contents, codes))
    same = (codes[by_content][1:] == codes[by_content][:-1]) & (contents[by_content][1:] == contents[by_content][:-1])
    exact = np.zeros(n, dtype=bool)
    exact[by_content[1:][same]] = True
    generated = pc.binary_join_element_wise(names, pa.array(positions).cast(pa.string()), "@")
    keys = pc.if_else(pa.array(repeat), generated, names)
    first_of = np.zeros(int(unique.max()) + 1 if n else 0, dtype=np.int64)
    first_of[unique] = positions[first]
    examples = []
    for i in np.flatnonzero(repeat)[:max_examples].tolist():
        same_text = "the same conversation" if exact[i] else "another conversation"
        examples.append(f"{names[i].as_py()!r} at #{first_of[codes[i]]} and #{positions[i]} ({same_text})")
    return keys, int(repeat.sum()), int(exact.sum()), examples
