"""`gpufeed prepare` over hostile sources of every format: each ends as a reject or a gpufeed error, in bounded time.

Each case (tests/prepare/hostile_sources.py builds it: a real small
dataset with one file or field spoiled) is prepared by the library, and
must end one of two ways:

- the sample it spoils is rejected, its reason in rejected.jsonl naming the
  file or field, and the rest of the dataset is prepared;
- the whole source is refused with a gpufeed error whose message names the
  file and field (a broken annotation file, data.yaml or list).

Never another exception, never a hang (each test has a timeout: a FIFO read
would block for ever). The cases about memory or a native crash run through
the real CLI in a child process under an address-space limit, which also
shows that no traceback reaches the user.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import hostile_sources as hs
import pytest

from pipeline import PrepareSpec, ResizeSpec, prepare_dataset
from pipeline.errors import ConfigError, GpufeedError, SourceError

MEMORY_LIMIT = 512 << 20  # address space of a CLI child: a prepare of these datasets needs under 400 MiB
CLI_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Rejects:
    """`count` samples rejected, each reason holding all `words`; the others prepared."""

    words: tuple[str, ...] = ()
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Refused:
    """The source refused: a gpufeed error of type `error` whose message holds all `words`."""

    error: type[GpufeedError]
    words: tuple[str, ...]


ACCEPTED = Rejects(count=0)
Build = Callable[[Path], str]
Expect = Rejects | Refused

CASES: list[tuple[str, Build, Expect]] = [
    # COCO: numbers past the float range, NaN, RLE counts past int64, deep nesting, URLs, FIFOs
    ("coco-bbox-400-digits", lambda r: hs.coco(r, hs.bbox_width("@RAW@"), hs.DIGITS_400), Rejects(("annotation 1", "bbox", "finite"))),
    ("coco-bbox-infinity", lambda r: hs.coco(r, hs.bbox_width("@RAW@"), "Infinity"), Rejects(("bbox", "finite"))),
    ("coco-bbox-nested", lambda r: hs.coco(r, hs.annotation(bbox="@RAW@"), hs.nested(900)), Rejects(("bbox", "[[[[...]]]]"))),
    ("coco-width-400-digits", lambda r: hs.coco(r, hs.image_0(width="@RAW@"), hs.DIGITS_400), ACCEPTED),  # no size declared
    ("coco-category-400-digits", lambda r: hs.coco(r, hs.annotation(category_id="@RAW@"), hs.DIGITS_400), Rejects(("category_id",))),
    ("coco-polygon-400-digits", lambda r: hs.coco(r, hs.annotation(segmentation="@RAW@"), f"[[1, 1, {hs.DIGITS_400}, 1, 5, 5]]"),
     Rejects(("segmentation 0", "finite"))),
    ("coco-polygon-nan", lambda r: hs.coco(r, hs.annotation(segmentation="@RAW@"), "[[1, 1, NaN, 1, 5, 5]]"), Rejects(("finite",))),
    ("coco-rle-count-past-int64", lambda r: hs.coco(r, hs.rle([10**30, 5])), Rejects(("segmentation 0", "RLE count"))),
    ("coco-segmentation-nested", lambda r: hs.coco(r, hs.annotation(segmentation="@RAW@"), hs.nested(200)),
     Rejects(("segmentation", "nests over 32"))),
    ("coco-file-name-http", lambda r: hs.coco(r, hs.image_0(file_name="http://example.com/a.jpg")), Rejects(("file_name", "is a URL"))),
    ("coco-file-name-s3", lambda r: hs.coco(r, hs.image_0(file_name="s3://bucket/a.jpg")), Rejects(("is a URL",))),
    ("coco-file-name-data", lambda r: hs.coco(r, hs.image_0(file_name="data:image/jpeg;base64,AAAA")), Rejects(("is a URL",))),
    ("coco-file-name-dotdot", hs.coco_outside("../secret.jpg"), Rejects(("file_name", "not a path inside the dataset folder"))),
    ("coco-file-name-absolute", hs.coco_outside("absolute"), Rejects(("file_name", "not a path inside the dataset folder"))),
    ("coco-image-fifo", hs.coco_fifo_image, Rejects(("a FIFO, not a regular file",))),
    ("coco-json-5000-digits", lambda r: hs.coco(r, hs.annotation(area="@RAW@"), hs.DIGITS_5000),
     Refused(ConfigError, ("instances_train.json", "not valid JSON", "4300 digits"))),
    ("coco-json-nested-past-parsing", lambda r: hs.coco(r, hs.annotation(segmentation="@RAW@"), hs.nested(100_000)),
     Refused(ConfigError, ("instances_train.json", "not valid JSON"))),
    # YOLO: class ids that are no int, data.yaml nested, numbers past the limit, FIFOs
    ("yolo-class-superscript", lambda r: hs.yolo(r, "\u00b2 0.5 0.5 0.1 0.1\n"), Rejects(("labels/000000.txt:1", "not a class id"))),
    ("yolo-class-5000-digits", lambda r: hs.yolo(r, f"{hs.DIGITS_5000} 0.5 0.5 0.1 0.1\n"), Rejects(("labels/000000.txt:1", "not a class id"))),
    ("yolo-coordinate-5000-digits", lambda r: hs.yolo(r, f"0 {hs.DIGITS_5000} 0.5 0.1 0.1\n"), Rejects(("labels/000000.txt:1", "normalised"))),
    ("yolo-label-fifo", hs.yolo_fifo("labels/000000.txt"), Rejects(("000000.txt", "a FIFO"))),
    ("yolo-yaml-nested", lambda r: hs.yolo(r, yaml=f"train: images\nnames: {hs.nested(5000, 'a')}\n"),
     Refused(ConfigError, ("data.yaml", "not valid YAML"))),
    ("yolo-yaml-nc-nested", lambda r: hs.yolo(r, yaml=f"train: images\nnc: {hs.nested(150)}\nnames: [a]\n"),
     Refused(ConfigError, ("data.yaml", "'nc'"))),
    ("yolo-yaml-nc-alias-bomb", lambda r: hs.yolo(r, yaml=hs.alias_bomb()), Refused(ConfigError, ("data.yaml", "'nc'"))),
    ("yolo-yaml-nc-5000-digits", lambda r: hs.yolo(r, yaml=f"train: images\nnc: {hs.DIGITS_5000}\n"),
     Refused(ConfigError, ("data.yaml", "not valid YAML"))),
    ("yolo-yaml-fifo", hs.yolo_fifo("data.yaml"), Refused(SourceError, ("data.yaml", "a FIFO"))),
    ("yolo-image-list-fifo", hs.yolo_list_fifo, Refused(SourceError, ("train.txt", "a FIFO"))),
    # Pascal VOC and segmentation folders
    ("voc-xml-fifo", lambda r: hs.voc(r, fifo=True), Rejects(("000000.xml", "a FIFO"))),
    ("voc-coordinate-400-digits", lambda r: hs.voc(r, hs.voc_box(hs.DIGITS_400)), Rejects(("000000.xml", "four finite numbers"))),
    ("voc-coordinate-5000-digits", lambda r: hs.voc(r, hs.voc_box(hs.DIGITS_5000)), Rejects(("000000.xml", "four finite numbers"))),
    ("segmentation-mask-fifo", hs.segmentation_fifo("masks/000000.png"), Rejects(("mask", "000000.png", "a FIFO"))),
    ("segmentation-classes-fifo", hs.segmentation_fifo("classes.txt"), Refused(ConfigError, ("classes.txt", "a FIFO"))),
    # CSV / JSONL lists: long fields, bytes that are not UTF-8, deep columns, labels, FIFOs, URLs
    ("csv-caption-200-kib", hs.csv_row(caption="a" * (200 << 10)), ACCEPTED),
    ("csv-caption-2-mib", hs.csv_row(caption="a" * (2 << 20)), Rejects(("list.csv:2", "'caption'", "bytes a text may have"))),
    ("csv-caption-not-utf8", lambda r: hs.listed(r, b"train/000000.jpg,caf\xe9\n"), Rejects(("list.csv:2", "'caption'", "UTF-8"))),
    ("csv-path-not-utf8", hs.csv_non_utf8_path, ACCEPTED),  # a file name is bytes: it is read
    ("csv-row-over-the-bound", hs.csv_row(caption="a" * (17 << 20)), Refused(ConfigError, ("list.csv:2", "a row is over"))),
    ("csv-label-superscript", hs.csv_label("\u00b2"), ACCEPTED),  # a name, not an index
    ("csv-label-past-the-classes", hs.csv_label("99999999999"), Refused(ConfigError, ("labels", "class indices"))),
    ("csv-image-fifo", hs.csv_fifo_image, Rejects(("a FIFO, not a regular file",))),
    ("csv-unknown-scheme", hs.csv_row(path="nope://bucket/a.jpg"), Rejects(("nope://bucket/a.jpg",))),
    ("csv-list-is-a-fifo", hs.csv_is_fifo, Refused(SourceError, ("list.csv", "neither a folder nor a regular file"))),
    ("jsonl-caption-not-utf8", hs.jsonl_row(b'{"path": "train/000000.jpg", "caption": "caf\xe9"}'), Rejects(("list.jsonl:1", "'caption'", "UTF-8"))),
    ("jsonl-column-nested", hs.jsonl_row(b'{"path": "train/000000.jpg", "caption": "x", "extra": ' + hs.nested(500).encode() + b"}"),
     Rejects(("list.jsonl:1", "'extra'", "nests over 32"))),
    ("jsonl-column-nan", hs.jsonl_row(b'{"path": "train/000000.jpg", "caption": "x", "extra": [1, NaN, Infinity]}'),
     Rejects(("list.jsonl:1", "'extra'", "not finite"))),
    ("jsonl-label-nested", hs.jsonl_row(b'{"path": "train/000000.jpg", "label": ' + hs.nested(900).encode() + b"}"), Rejects(("'label'",))),
    ("jsonl-line-nested-past-parsing", hs.jsonl_row(b'{"path": "a.jpg", "x": ' + hs.nested(100_000).encode() + b"}"),
     Refused(ConfigError, ("list.jsonl:1", "not valid JSON"))),
    ("jsonl-5000-digits", hs.jsonl_row(b'{"path": "train/000000.jpg", "x": ' + hs.DIGITS_5000.encode() + b"}"),
     Refused(ConfigError, ("list.jsonl:1", "not valid JSON"))),
    # img2dataset shards
    ("shard-json-nested", lambda r: hs.shard(r, json=hs.nested(500).encode()), Rejects(("json member", "nests over 32"))),
    ("shard-json-5000-digits", lambda r: hs.shard(r, json=hs.DIGITS_5000.encode()), Rejects(("json member", "not valid JSON"))),
    ("shard-caption-not-utf8", lambda r: hs.shard(r, txt=b"caf\xe9"), ACCEPTED),  # replaced, as every text member
    ("shard-label-superscript", lambda r: hs.shard(r, cls="\u00b2".encode()), ACCEPTED),
    ("shard-fifo", hs.shard_fifo, Refused(SourceError, ("00001.tar", "a FIFO"))),
]


@pytest.mark.timeout(20, method="thread")  # ends a hang even where a blocked read would not see a signal
@pytest.mark.parametrize(("build", "expect"), [pytest.param(b, e, id=name) for name, b, e in CASES])
def test_a_hostile_source_ends_as_a_reject_or_a_gpufeed_error(tmp_path: Path, build: Build, expect: Expect) -> None:
    source = build(tmp_path / "src")
    out = tmp_path / "out"
    spec = PrepareSpec(source=source, out=str(out), resize=ResizeSpec(size=16))
    if isinstance(expect, Refused):
        with pytest.raises(GpufeedError) as raised:
            prepare_dataset(spec, workers=0)
        assert isinstance(raised.value, expect.error), f"{type(raised.value).__name__}: {raised.value}"
        _assert_words(str(raised.value), expect.words)
        return
    result = prepare_dataset(spec, workers=0)
    _assert_rejects(out, result.listed, result.samples, expect)


def _assert_rejects(out: Path, listed: int, samples: int, expect: Rejects) -> None:
    reasons = [json.loads(line)["reason"] for line in (out / "rejected.jsonl").read_text().splitlines() if line.strip()]
    assert len(reasons) == expect.count, reasons
    for reason in reasons:
        _assert_words(reason, expect.words)
    assert samples == listed - expect.count and samples >= 2, (listed, samples)


def _assert_words(text: str, words: tuple[str, ...]) -> None:
    missing = [word for word in words if word not in text]
    assert not missing, f"{missing} not in: {text[:500]}"


# -- through the CLI, in a child process under an address-space limit --------------------


def _cli(source: str, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    command = [sys.executable, "-m", "pipeline", "prepare", source, str(out), "--json", "--quiet", "--size", "16", *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, preexec_fn=limit)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1), f"exit {done.returncode} (a negative one is a signal):\n{done.stderr[-3000:]}"
    return done


CLI_CASES: list[tuple[str, Build, Expect, tuple[str, ...]]] = [
    # int64 sums that wrap: numpy would be handed counts it cannot hold (the process once died of SIGSEGV)
    ("coco-rle-counts-wrap-int64", lambda r: hs.coco(r, hs.rle(hs.wrapping_counts)), Rejects(("segmentation 0", "RLE count")), ()),
    ("coco-rle-string-wraps-int64", lambda r: hs.coco(r, hs.rle(hs.wrapping_string)), Rejects(("segmentation 0", "RLE")), ()),
    # deep enough to parse, too deep to pickle for the pool's workers
    ("coco-segmentation-nested-pool", lambda r: hs.coco(r, hs.annotation(segmentation="@RAW@"), hs.nested(900)),
     Rejects(("nests over 32",)), ("--workers", "2")),
    ("jsonl-column-nested-pool", hs.jsonl_row(b'{"path": "train/000000.jpg", "caption": "x", "extra": ' + hs.nested(900).encode() + b"}"),
     Rejects(("nests over 32",)), ("--workers", "2")),
    # memory: over the documented bound (a sparse file), and a file within it too big to parse here
    ("coco-json-of-a-gigabyte", hs.coco_of_a_gigabyte, Refused(ConfigError, ("instances_train.json", "over the bound", "GPUFEED_MAX_JSON_BYTES")), ()),
    ("coco-json-past-memory", hs.coco_too_big_to_parse, Refused(ConfigError, ("instances_train.json", "does not fit in this process's memory")), ()),
    ("csv-row-over-the-bound-cli", hs.csv_row(caption="a" * (17 << 20)), Refused(ConfigError, ("list.csv:2", "a row is over")), ()),
]


@pytest.mark.timeout(CLI_TIMEOUT_S + 10)
@pytest.mark.parametrize(("build", "expect", "options"), [pytest.param(b, e, o, id=name) for name, b, e, o in CLI_CASES])
def test_the_cli_ends_a_hostile_source_cleanly_in_bounded_memory(tmp_path: Path, build: Build, expect: Expect, options: tuple[str, ...]) -> None:
    source = build(tmp_path / "src")
    out = tmp_path / "out"
    done = _cli(source, out, "--workers", "0", *options) if "--workers" not in options else _cli(source, out, *options)
    if isinstance(expect, Refused):  # with --json, the error is {"error": message} on stdout
        assert done.returncode == 1, done.stderr[-2000:]
        _assert_words(json.loads(done.stdout)["error"], expect.words)
        return
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    _assert_rejects(out, summary["listed"], summary["samples"], expect)


def test_a_list_may_name_files_anywhere_but_the_service_checks_each_against_its_roots(tmp_path: Path) -> None:
    """A list names its files (relative to its folder, `..`, absolute: the list is the dataset); the
    service, which must not read outside GPUFEED_ALLOWED_ROOTS, checks every listed path."""
    from worker.security import listed_source_check

    root = tmp_path / "root"
    source = hs.listed(root, b"../outside.jpg,x\n")
    check = listed_source_check(source, [str(root)])
    assert check is not None
    check(str(root / "train" / "000001.jpg"))
    for outside in (f"{root}/../outside.jpg", str(tmp_path / "outside.jpg"), "/etc/passwd"):
        with pytest.raises(ConfigError, match="outside GPUFEED_ALLOWED_ROOTS"):
            check(outside)
