"""A CSV or JSONL list as a source: one row a sample, `path` and the columns that say what it holds.

Every row needs a `path` (relative to the list file's folder, absolute, or
a URL); `label` is a class name, `labels` several (a JSON list or `a;b`),
`caption` or `text` a caption; other columns are kept as they are
(`SourceItem.targets["columns"]`). A row of `path` (and `label`) alone is
classification, listed exactly as always.

The file is read as hostile: a row is at most `ROW_MAX_CHARS` characters
(a longer one, or a line that is not CSV, is a `ConfigError` naming the file
and line: the rows after it cannot be told apart). Text that is not UTF-8
keeps its bytes in a path (a file's name is bytes) and rejects its row
anywhere else, naming the column; so do a caption over the bound on a
text, a column nested over `MAX_JSON_DEPTH` levels and a label that is not
one name.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from typing import Any

from ...errors import ConfigError, SourceError
from ...io.fs import local_path, open_fs, open_regular, store_errors
from ...manifest import nested_deeper
from ...targets import MAX_CAPTION_BYTES
from .common import MAX_JSON_DEPTH, ListingInfo, SourceItem, brief, printable

LIST_COLUMNS = ("path", "label", "labels", "caption", "text")  # the columns a list's rows have a meaning for
ROW_MAX_CHARS = 16 << 20
"""Characters one row of a list may have (its lines together): far past any real one, and what a row costs in memory."""


def list_rows(source: str, base: str, info: ListingInfo, *, is_csv: bool) -> Iterator[SourceItem]:
    """Yield one item per row of a CSV (`is_csv`) or JSONL list, its relative paths under `base`.

    Raises:
        SourceError: the file cannot be read, or is not a regular file.
        ConfigError: no `path` in a row (or in the CSV header), a line that is
            not CSV or JSON, a row over `ROW_MAX_CHARS`.
    """
    info.kind = "list"
    rows = _read_csv_rows(source) if is_csv else _read_jsonl_rows(source)
    name = os.path.basename(source.split("?", 1)[0])
    seen = {"label": False, "labels": False, "caption": False}
    for line_no, row in rows:
        path = row.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{source}:{line_no}: every row needs a non-empty 'path'")
        url = path if ("://" in path or os.path.isabs(path)) else f"{base}/{path}"
        problem = _row_problem(row)
        if problem:
            yield SourceItem(url, path.lstrip("/"), None, f"{name}:{line_no}: {problem}")
            continue
        label = row.get("label")
        label = None if label in (None, "") else str(label)
        seen["label"] |= label is not None
        if len(row) == 1 or (len(row) == 2 and "label" in row):  # path (+ label): classification, as always
            yield SourceItem(url, path.lstrip("/"), label)
            continue
        targets, rejected = _row_targets(row, seen)
        yield SourceItem(url, path.lstrip("/"), label, f"{name}:{line_no}: {rejected}" if rejected else "", targets)
    if seen["labels"]:
        info.task = "multilabel"
    elif seen["caption"] and not seen["label"]:
        info.task = "captions"


def _row_problem(row: dict[str, Any]) -> str:
    """Why a row is rejected whatever its columns mean: a column too deep or not UTF-8, a label that is no name; "" if none."""
    for column, value in row.items():
        if column == "path":
            continue  # a file name may be any bytes: surrogate-escaped, it still opens the file
        if nested_deeper(value, MAX_JSON_DEPTH):
            return f"its column {brief(column)} nests over {MAX_JSON_DEPTH} levels deep"
        try:  # a lone surrogate anywhere in it (bytes that are not UTF-8, or a JSON escape of one) fails here
            json.dumps([column, value], ensure_ascii=False, allow_nan=False).encode("utf-8")
        except UnicodeEncodeError:
            return f"its column {brief(column)} is not valid UTF-8 text"
        except ValueError:  # NaN or Infinity: Python's JSON reads them, the sample's .json could not carry them as JSON
            return f"its column {brief(column)} holds a number that is not finite (NaN or Infinity)"
    if isinstance(row.get("label"), (list, dict)):
        return "its 'label' must be one class name (a list of several goes in 'labels')"
    return ""


def _row_targets(row: dict[str, Any], seen: dict[str, bool]) -> tuple[dict[str, Any] | None, str]:
    """A list row's targets: "labels", "caption" (from `caption` or `text`) and the other columns; or why not."""
    targets: dict[str, Any] = {}
    if "labels" in row:
        seen["labels"] = True
        labels = _labels_of(row["labels"])
        if isinstance(labels, str):
            return None, labels
        targets["labels"] = labels
    for name in ("caption", "text"):
        value = row.get(name)
        if value is None or "caption" in targets:
            continue
        if not isinstance(value, str):
            return None, f"its {name!r} must be text, not {type(value).__name__}"
        if len(value) > MAX_CAPTION_BYTES // 4 and len(value.encode("utf-8")) > MAX_CAPTION_BYTES:
            return None, f"its {name!r} is over the {MAX_CAPTION_BYTES} bytes a text may have"
        targets["caption"] = value
        seen["caption"] = True
    columns = {name: value for name, value in row.items() if name not in LIST_COLUMNS}
    if columns:
        targets["columns"] = columns
    return targets or None, ""


def _labels_of(value: Any) -> list[str] | str:
    """A `labels` cell as class names: a JSON list, a JSON list in text, or `;`-separated names (empty: none)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                return f"its labels {text[:60]!r} start like a JSON list but are not one"
        else:
            return [part.strip() for part in text.split(";") if part.strip()]
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return "its labels must be a list of class names (or a ';'-separated string)"
    names = [printable(str(v).strip()) for v in value]
    return [name for name in names if name]


def _open_text(source: str) -> io.TextIOWrapper:
    """The list as text: UTF-8, bytes that are not kept surrogate-escaped (`_row_problem` tells where)."""
    local = local_path(source)
    try:
        if local is not None:
            raw = open_regular(local)
        else:
            fs, path = open_fs(source)
            raw = fs.open(path, "rb")
    except OSError as exc:
        raise SourceError(f"cannot read {source}: {exc.strerror or exc}") from exc
    except store_errors() as exc:
        raise SourceError(f"cannot read {source}: {exc}") from exc
    return io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")


class _Lines:
    """A list's lines, as its reader takes them, each row's (`start_row`) at most `ROW_MAX_CHARS` characters."""

    def __init__(self, handle: io.TextIOWrapper, source: str) -> None:
        self.handle, self.source = handle, source
        self.number = 0  # of the last line taken
        self.taken = 0  # characters of the row being read

    def start_row(self) -> None:
        self.taken = 0

    def __iter__(self) -> Iterator[str]:
        while True:
            line = self.handle.readline(ROW_MAX_CHARS + 1 - self.taken)
            if not line:
                return
            self.number += 1
            self.taken += len(line)
            if self.taken > ROW_MAX_CHARS:
                raise ConfigError(f"{self.source}:{self.number}: a row is over {ROW_MAX_CHARS} characters, the bound on one row of a list")
            yield line


def _read_csv_rows(source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    if csv.field_size_limit() < ROW_MAX_CHARS:  # the module's default, 128 KiB, is less than a caption may be
        csv.field_size_limit(ROW_MAX_CHARS)
    with _open_text(source) as handle:
        lines = _Lines(handle, source)
        reader = csv.DictReader(iter(lines))
        try:
            if reader.fieldnames is None or "path" not in reader.fieldnames:
                raise ConfigError(f"{source}: the CSV header must have a 'path' column (and optionally 'label')")
            while True:
                lines.start_row()
                row = next(reader, None)
                if row is None:
                    return
                row.pop(None, None)  # fields past the header's (csv keeps them under None): no column to name them
                yield lines.number, row
        except csv.Error as exc:
            raise ConfigError(f"{source}:{lines.number}: not a CSV row ({exc})") from None


def _read_jsonl_rows(source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open_text(source) as handle:
        lines = _Lines(handle, source)
        for line in lines:
            lines.start_row()
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{source}:{lines.number}: not valid JSON ({exc.msg})") from exc
            except (ValueError, RecursionError) as exc:  # nested too deep, or an integer of over 4300 digits
                raise ConfigError(f"{source}:{lines.number}: not valid JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{source}:{lines.number}: each line must be a JSON object with 'path'")
            yield lines.number, row
