"""A job's files changed under the service: its shard tasks re-check every file they open against the allowed roots.

Real Redis, a real `gpufeed worker` process (service_harness). The plan's listing in OUT is edited
while the job runs, as anyone who can write OUT could: its lines then name files outside
GPUFEED_ALLOWED_ROOTS, a FIFO there (which would hang the task that opened it), and links inside
the roots that lead outside. None is opened: each is rejected with a reason that says why.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from service_harness import SLOW_FLAGS, Service, dataset_samples

pytestmark = pytest.mark.slow
pytest_plugins = ["service_fixtures"]  # service, small_raw, slow_raw


@pytest.fixture
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder outside every allowed root (the service's roots are pytest's temp folder)."""
    folder = Path(tempfile.mkdtemp(prefix="o", dir="/tmp"))
    try:
        assert not folder.resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve())
        Image.new("RGB", (97, 61), (250, 0, 250)).save(folder / "i.png")  # would be a sample of its own
        os.mkfifo(folder / "f.png")  # opened, it waits for a writer for ever
        yield folder
    finally:
        shutil.rmtree(folder)


def _edit_listing(work: Path, targets: list[str]) -> None:
    """Point the listing's lines at `targets` in turn, each line kept at its length (the offsets index stays valid)."""
    lines = (work / "listing.jsonl").read_bytes().splitlines(keepends=True)
    edited = []
    for number, line in enumerate(lines):
        fields = json.loads(line)
        fields[0] = targets[number % len(targets)]
        text = json.dumps(fields).encode()
        assert len(text) < len(line), "the edited path must be shorter than the listed one"
        edited.append(text[:-1] + b" " * (len(line) - len(text) - 1) + b"]\n")  # JSON allows the spaces
    temp = work / "listing.jsonl.edit"
    temp.write_bytes(b"".join(edited))
    os.replace(temp, work / "listing.jsonl")  # a shard task opens either the planned lines or these


@pytest.mark.timeout(120)
def test_a_listing_edited_after_the_plan_makes_no_shard_task_open_a_file_outside_the_roots(
    service: Service, slow_raw: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, outside: Path
) -> None:
    """Once planned, every line names an image outside the roots, a FIFO there, or a link inside them to outside."""
    link = tmp_path_factory.getbasetemp() / f"l{os.getpid()}"  # inside the roots, leading outside
    link.symlink_to(outside / "i.png")
    try:
        _run_edited(service, slow_raw, tmp_path / "out", [str(outside / "i.png"), str(outside / "f.png"), str(link)])
    finally:
        link.unlink()


def _run_edited(service: Service, raw: Path, out: Path, targets: list[str]) -> None:
    service.start_worker("w1")
    job = service.submit("prepare", str(raw), str(out), *SLOW_FLAGS)
    # one shard written from the planned lines, so the job has samples left to finish with; the rest read the edit
    service.wait_until(job, lambda r: r.shards_done >= 1, 60, "one shard done")
    _edit_listing(out / ".gpufeed", targets)

    record = service.wait_finished(job, timeout=60)  # a FIFO opened would hold its shard task for ever
    assert record.state == "succeeded", record.error
    assert record.rejected >= 3, "the shard tasks after the edit read the edited listing"
    assert record.samples + record.rejected == 40
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == record.rejected
    assert {entry["source"] for entry in rejected} <= set(targets)
    assert all("outside GPUFEED_ALLOWED_ROOTS" in entry["reason"] for entry in rejected), rejected
    sources = {json.loads(members["json"])["source"] for members in dataset_samples(out).values()}
    assert sources and all(source.startswith(str(raw)) for source in sources)  # none read from outside
