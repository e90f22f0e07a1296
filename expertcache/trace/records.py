"""`RecordChecker`: the checked fields of JSON-lines routing records.

Each loader reads its fields through one checker per file, so every record is held to the
same rules and every message names the file, the line and the field:

* indices (``layer``, ``token_pos``, ``token_idx``) are non-negative JSON integers (a float,
  a bool, a string or null is refused, never truncated or cast);
* an expert list holds exactly top-k distinct integer ids (top-k from the file's metadata,
  else from its first record), each below ``num_experts`` when that is known;
* identity fields (``prompt_id``, ``problem_id``) are integers or strings.
"""

from __future__ import annotations

from pathlib import Path

from expertcache.trace.arrays import MAX_EXPERTS
from expertcache.trace.errors import TraceFileError
from expertcache.trace.jsonl import json_type

_INDEX_LIMIT = 2**63 - 1


class RecordChecker:
    """Reads fields of one file's records.

    Args:
        path: the file (named in every message).
        num_experts: every id must be below it (None: below 2**31 - 1).
        top_k: ids per record (None: taken from the first expert list read).
    """

    def __init__(self, path: str | Path, *, num_experts: int | None = None, top_k: int | None = None) -> None:
        self.path = Path(path)
        self.num_experts = num_experts
        self.top_k = top_k

    def fail(self, line: int, message: str) -> TraceFileError:
        """The error to raise for line ``line``."""
        return TraceFileError(self.path, message, line=line)

    def field(self, line: int, record: dict, key: str) -> object:
        """``record[key]``, or an error naming the missing field."""
        if key not in record:
            raise self.fail(line, f"missing field {key!r}")
        return record[key]

    def index(self, line: int, record: dict, key: str) -> int:
        """A non-negative integer field."""
        value = self.field(line, record, key)
        if type(value) is not int:
            raise self.fail(line, f"{key!r} must be a non-negative integer, got {json_type(value)} {value!r:.40}")
        if value < 0:
            raise self.fail(line, f"{key!r} must be a non-negative integer, got {value}")
        if value > _INDEX_LIMIT:
            raise self.fail(line, f"{key!r} must be below 2**63, got {value!r:.40}")
        return value

    def identity(self, line: int, record: dict, key: str) -> int | str:
        """An integer or string field that tells records apart (a prompt or problem id)."""
        value = self.field(line, record, key)
        if type(value) not in (int, str):
            raise self.fail(line, f"{key!r} must be an integer or a string, got {json_type(value)}")
        return value  # type: ignore[return-value]

    def experts(self, line: int, record: dict, key: str) -> tuple[int, ...]:
        """Exactly top-k distinct expert ids in range."""
        value = self.field(line, record, key)
        if not isinstance(value, list):
            raise self.fail(line, f"{key!r} must be a list of expert ids, got {json_type(value)}")
        if self.top_k is None:
            if not value:
                raise self.fail(line, f"{key!r} is empty; a record has at least one expert id")
            self.top_k = len(value)
        if len(value) != self.top_k:
            raise self.fail(line, f"{key!r} must hold exactly {self.top_k} expert ids (top-k), got {len(value)}")
        limit = self.num_experts if self.num_experts is not None else MAX_EXPERTS
        for expert in value:
            if type(expert) is not int:
                raise self.fail(line, f"{key!r} must hold integer expert ids, got {json_type(expert)} {expert!r:.40}")
            if not 0 <= expert < limit:
                known = f"num_experts is {limit}" if self.num_experts is not None else f"ids must be below {limit}"
                raise self.fail(line, f"{key!r} holds expert id {expert!r:.40}, out of range ({known})")
        if len(set(value)) != len(value):
            raise self.fail(line, f"{key!r} repeats an expert id: {value!r:.80}")
        return tuple(value)
