"""A file swapped for a link to outside the roots after its check is closed unread (`pipeline.io.fs.confined_opens`).

The service's shard tasks check every file the listing names against
GPUFEED_ALLOWED_ROOTS before opening it (`worker.security.opened_source_check`),
but a path checked can change before it is opened. These tests win that race
on purpose: the check passes, then the file becomes a link to a file outside
the roots, then the shard opens it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from pipeline.io.fs import confined_opens, open_regular, read_source_bytes
from pipeline.manifest import read_manifest
from pipeline.prepare.job import prepare_dataset
from pipeline.prepare.steps import finish_prepare, plan_prepare, write_prepare_shard
from pipeline.specs import PrepareSpec
from worker import security


@pytest.fixture()
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """(an allowed root holding raw/ with 6 images in two classes, a folder outside it holding secret.png)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for index in range(6):
        folder = root / "raw" / f"c{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 24), (40 * index, 90, 30)).save(folder / f"i{index}.png")
    outside.mkdir()
    Image.new("RGB", (32, 24), (255, 0, 255)).save(outside / "secret.png")
    return root, outside


def test_a_file_opened_inside_the_roots_is_read_and_a_link_out_of_them_is_closed_unread(roots: tuple[Path, Path]) -> None:
    root, outside = roots
    inside = root / "raw" / "c0" / "i0.png"
    link = root / "raw" / "c0" / "out.png"
    link.symlink_to(outside / "secret.png")
    with confined_opens([str(root), "s3://bucket/prefix"]):
        assert read_source_bytes(str(inside), 1 << 20) == inside.read_bytes()
        with pytest.raises(OSError, match="outside the allowed roots") as raised:
            read_source_bytes(str(link), 1 << 20)
        assert str(outside / "secret.png") in str(raised.value)
    with open_regular(str(link)) as handle:  # outside the block, opens are not confined
        assert handle.read() == (outside / "secret.png").read_bytes()


def test_with_only_url_roots_no_local_file_opens(roots: tuple[Path, Path]) -> None:
    root, _ = roots
    with confined_opens(["s3://bucket/prefix"]), pytest.raises(OSError, match="none local"):
        open_regular(str(root / "raw" / "c0" / "i0.png"))


def _racing_check(roots: list[str], outside: Path, swapped: list[str]) -> Callable[[str], None]:
    """The service's check of each listed file, after which the file is swapped for a link out of the roots."""
    check = security.opened_source_check(roots)

    def racing(url: str) -> None:
        check(url)  # passes: the file is still the one the plan listed
        if not swapped and url.endswith(".png"):
            os.unlink(url)
            os.symlink(outside / "secret.png", url)
            swapped.append(url)

    return racing


def test_a_shard_whose_file_is_swapped_after_its_check_rejects_it_and_reads_nothing_outside(roots: tuple[Path, Path]) -> None:
    """A service shard task's way: the listing checked item by item, the shard written in this process."""
    root, outside = roots
    out = root / "out"
    spec = PrepareSpec.from_dict({"source": str(root / "raw"), "out": str(out), "shards": {"max_samples": 100}})
    allowed = [str(root)]
    assert plan_prepare(spec, check_source=security.listed_source_check(spec.source, allowed)).shards == 1
    swapped: list[str] = []
    with confined_opens(allowed):
        written = write_prepare_shard(spec, 0, check_source=_racing_check(allowed, outside, swapped))
    finish_prepare(spec)
    assert len(swapped) == 1
    assert (written.samples, written.rejected) == (5, 1)
    _assert_rejected_unread(out, outside, swapped, 5)


def test_forked_prepare_workers_inherit_the_confinement(roots: tuple[Path, Path]) -> None:
    root, outside = roots
    link = root / "raw" / "c1" / "zz.png"
    link.symlink_to(outside / "secret.png")
    out = root / "out"
    spec = PrepareSpec.from_dict({"source": str(root / "raw"), "out": str(out), "shards": {"max_samples": 100}})
    with confined_opens([str(root)]):
        result = prepare_dataset(spec, workers=2)
    assert (result.samples, result.rejected) == (6, 1)
    _assert_rejected_unread(out, outside, [str(link)], 6)


def _assert_rejected_unread(out: Path, outside: Path, sources: list[str], samples: int) -> None:
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [entry["source"] for entry in rejected] == sources
    assert all("outside the allowed roots" in entry["reason"] for entry in rejected), rejected
    secret = (outside / "secret.png").read_bytes()
    assert read_manifest(str(out)).samples == samples
    assert all(secret not in shard.read_bytes() for shard in out.rglob("*.tar"))


def test_without_the_confinement_the_swapped_file_would_be_read(roots: tuple[Path, Path]) -> None:
    """What the confinement stops: the same race, outside it, puts the file from outside the roots in the shard."""
    root, outside = roots
    out = root / "out"
    spec = PrepareSpec.from_dict({"source": str(root / "raw"), "out": str(out), "shards": {"max_samples": 100}})
    plan_prepare(spec)
    swapped: list[str] = []
    written = write_prepare_shard(spec, 0, check_source=_racing_check([str(root)], outside, swapped))
    assert (written.samples, written.rejected) == (6, 0)
