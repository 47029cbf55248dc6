"""A data format that lives outside mmtune: this module is all of it.

"toyqa" is one question about one picture per record, ``{"qa_id", "picture", "question",
"answer"}``. Importing the module registers it; ``mmtune data check FILE`` then detects
and reads such files, ``--format toyqa`` and a source's ``format: toyqa`` accept it, and
training reads it, without an edit anywhere else (``tests/data/test_toy_format.py``).
"""

from __future__ import annotations

from typing import Any, Optional

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.data.formats import ConvertContext, DataFormat, Detection, register_format
from mmtune.data.validation import Problem

FIELDS = ("qa_id", "picture", "question", "answer")


@register_format
class ToyQA(DataFormat):
    name = "toyqa"
    keys = "{qa_id, picture, question, answer}: one question about one picture"

    def detect(self, records: list[dict]) -> Detection:
        if all(all(key in r for key in FIELDS) for r in records):
            return Detection(1, "records have qa_id, picture, question and answer (toy QA)")
        return Detection(0)

    def convert(self, record: Any, index: int, ctx: ConvertContext) -> tuple[Optional[Dialogue], list[Problem]]:
        rid = str(record.get("qa_id", f"#{index}")) if isinstance(record, dict) else f"#{index}"
        missing = [key for key in FIELDS if not isinstance(record, dict) or not isinstance(record.get(key), str)]
        if missing:
            return None, [Problem("malformed_record", rid, index, None, f"no string {', '.join(missing)}")]
        image = ctx.resolve(record["picture"])
        if image.problem:
            return None, [Problem(image.problem, rid, index, 0, image.detail)]
        return Dialogue(rid, ctx.source, (Turn("user", (Image(image.path), record["question"])),
                                          Turn("assistant", (record["answer"],)))), []
