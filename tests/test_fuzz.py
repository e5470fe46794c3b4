"""Fuzzing the parsers of untrusted input: shards, manifests, verify and a loader epoch end in gpufeed's errors.

Hypothesis mutates real shards (written by TarShardWriter) and real manifests the
way an attacker or a broken copy would: flipped bytes, header fields rewritten
(size in octal, GNU base-256, huge or negative; mode, type flag, name, magic)
with the checksum made right again so the damage gets past it, PAX records
(`x` and `g`, sizes and paths) slipped in, archives cut anywhere; manifests
with any field replaced by any JSON value, keys dropped, JSON cut short or
nested deep. Whatever comes, the tar reader, `parse_manifest`, `verify_dataset`
and an epoch of `make_loader(on_error="skip")` only ever deliver or raise a
`GpufeedError`, never another exception, and what they hold stays bounded.

The number of examples per target is GPUFEED_FUZZ_EXAMPLES (default: a CI-sized
run; tests/README.md says how long the long run took). The peak RSS of the loader
and of `gpufeed inspect --verify` over a hostile corpus is checked in a child
process at the end.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile_data import base256, padded, pax_header, tar_file, tar_header
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.errors import GpufeedError
from pipeline.io.output import Output
from pipeline.io.tar import TarShardWriter, iter_tar_samples
from pipeline.manifest import MANIFEST_NAME, Manifest, parse_manifest, verify_dataset, write_manifest

EXAMPLES = int(os.environ.get("GPUFEED_FUZZ_EXAMPLES", "0")) or None  # None: the CI-sized defaults below
MEMBER_BOUND = 1 << 20  # the fuzzed reader's bound on one member: a mutation claiming more is refused
CLASSES = ["cat", "dog", "eel"]
SHARDS, PER_SHARD = 2, 6


def _examples(ci: int) -> int:
    return EXAMPLES or ci


def _fuzz_settings(ci: int) -> settings:
    return settings(
        max_examples=_examples(ci),
        deadline=None,
        derandomize=EXAMPLES is None,  # CI: the same examples every run; a long run explores
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
        database=None,
    )


# ---------------------------------------------------------------------------
# A real dataset to mutate


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (24, 24, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=80)
    return out.getvalue()


def write_dataset(root: Path) -> Manifest:
    """SHARDS shards of PER_SHARD samples (a 24 px JPEG, a label, a json) and their manifest."""
    output = Output(str(root))
    output.makedirs()
    shards = []
    for index in range(SHARDS):
        rel = f"shard-{index:06d}.tar"
        with TarShardWriter(str(root / rel)) as writer:
            for i in range(PER_SHARD):
                n = index * PER_SHARD + i
                writer.write_sample(f"s{n:04d}", {"jpg": _jpeg(n), "cls": str(n % 3).encode(), "json": b'{"n": %d}' % n})
            shards.append(writer.commit(rel))
    manifest = Manifest(SHARDS * PER_SHARD, CLASSES, shards, {"seed": 0}, "fuzz", 0)
    write_manifest(output, manifest)
    return manifest


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "ds"
    write_dataset(root)
    return root


def _header_offsets(data: bytes) -> list[int]:
    """Where each member header of a well-formed tar starts (the writer's tars: ustar, no PAX)."""
    offsets, position = [], 0
    while position + 512 <= len(data) and data[position : position + 512] != bytes(512):
        offsets.append(position)
        try:
            size = int(data[position + 124 : position + 135], 8)
        except ValueError:  # a header mutated already: the members after it are where they were
            size = 0
        position += 512 + size + (-size % 512)
    return offsets


def _fix_checksum(data: bytearray, at: int) -> None:
    header = data[at : at + 512]
    header[148:156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(header)


# ---------------------------------------------------------------------------
# Strategies: mutations of a shard


_FIELDS = {"name": (0, 100), "mode": (100, 8), "size": (124, 12), "mtime": (136, 12), "type": (156, 1), "magic": (257, 8), "prefix": (345, 155)}
_sizes = st.one_of(
    st.integers(-(2**80), 2**80).map(base256),
    st.integers(0, 2**33).map(lambda n: (b"%011o\0" % n)[-12:]),
    st.binary(min_size=12, max_size=12),
    st.sampled_from([b"+0000000001\0", b"0_00000001\0", b" " * 12, b"\0" * 12, b"77777777777\0", b"\xff" * 12]),
)
_pax_values = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.text(max_size=40),
    st.sampled_from(["", "0", "1048577", "99999999999999999999", "a.jpg", "../../etc/passwd", "s0001.cls"]),
)
_pax_records = st.dictionaries(st.sampled_from(["path", "size", "mtime", "linkpath", "comment", "x"]), _pax_values, max_size=3)

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("field"), st.integers(0, 40), st.sampled_from(sorted(_FIELDS)), st.binary(max_size=155), st.booleans()),
    st.tuples(st.just("size"), st.integers(0, 40), _sizes, st.booleans()),
    st.tuples(st.just("pax"), st.integers(0, 40), st.sampled_from([b"x", b"g"]), _pax_records),
    st.tuples(st.just("raw pax"), st.integers(0, 40), st.binary(max_size=64)),
    st.tuples(st.just("member"), st.integers(0, 40), st.text(max_size=30), st.binary(max_size=600)),
    st.tuples(st.just("cut"), st.integers(0, 10**6)),
    st.tuples(st.just("checksum"), st.integers(0, 40), st.sampled_from([1, -1, 256, 65521, -65521])),
)
mutations = st.lists(_mutation, min_size=1, max_size=4)


def mutate(data: bytes, changes: list[tuple[Any, ...]]) -> bytes:
    """Apply `changes` to a well-formed tar; header rewrites make the checksum right again unless told not to."""
    out = bytearray(data)
    for change in changes:
        offsets = _header_offsets(bytes(out)) or [0]
        kind = change[0]
        if kind == "flip":
            if out:
                out[change[1] % len(out)] ^= change[2]
        elif kind == "field":
            _, member, field, value, fix = change
            at = offsets[member % len(offsets)]
            start, width = _FIELDS[field]
            if at + 512 <= len(out):
                out[at + start : at + start + width] = value[:width].ljust(width, b"\0")
                if fix:
                    _fix_checksum(out, at)
        elif kind == "size":
            _, member, field, fix = change
            at = offsets[member % len(offsets)]
            if at + 512 <= len(out):
                out[at + 124 : at + 136] = field
                if fix:
                    _fix_checksum(out, at)
        elif kind == "pax":
            at = offsets[change[1] % len(offsets)]
            out[at:at] = pax_header({k: v.replace("\n", " ") for k, v in change[3].items()}, kind=change[2])
        elif kind == "raw pax":
            at = offsets[change[1] % len(offsets)]
            body = change[2]
            out[at:at] = tar_file_kind("././@PaxHeader", body, b"x")
        elif kind == "member":
            at = offsets[change[1] % len(offsets)]
            name = change[2].replace("\0", "")
            if len(name.encode()) <= 100:
                out[at:at] = tar_file(name, change[3])
        elif kind == "cut":
            del out[change[1] % (len(out) + 1) :]
        elif kind == "checksum":
            at = offsets[change[1] % len(offsets)]
            if at + 512 <= len(out):
                _fix_checksum(out, at)
                stored = int(bytes(out[at + 148 : at + 154]), 8) + change[2]
                if 0 <= stored < 8**6:
                    out[at + 148 : at + 156] = b"%06o\0 " % stored
    return bytes(out)


def tar_file_kind(name: str, data: bytes, kind: bytes) -> bytes:
    return tar_header(name, len(data), kind=kind) + padded(data)


def _shard_bytes(root: Path, index: int = 0) -> bytes:
    return (root / f"shard-{index:06d}.tar").read_bytes()


# ---------------------------------------------------------------------------
# The tar reader


@_fuzz_settings(300)
@given(changes=mutations, chunk_read=st.sampled_from([None, 700, 4096]))
def test_the_tar_reader_delivers_or_raises_tar_format_error(dataset: Path, changes, chunk_read) -> None:
    data = mutate(_shard_bytes(dataset), changes)

    class Dribble(io.BytesIO):  # a file that gives fewer bytes than asked, as a socket or pipe may
        def readinto(self, view):
            return super().readinto(memoryview(view)[:chunk_read])

        def read(self, size=-1):
            return super().read(size if size < 0 else min(size, chunk_read))

    handle = io.BytesIO(data) if chunk_read is None else Dribble(data)
    try:
        for key, members in iter_tar_samples(handle, "fuzz.tar", max_member=MEMBER_BOUND):
            assert isinstance(key, str)
            assert sum(len(value) for value in members.values()) <= MEMBER_BOUND  # what it holds stays bounded
    except GpufeedError:
        pass


# ---------------------------------------------------------------------------
# Manifests


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_paths = st.sampled_from(
    [("samples",), ("classes",), ("classes", 0), ("shards",), ("shards", 0), ("shards", 0, "samples"), ("shards", 0, "bytes"),
     ("shards", 0, "sha256"), ("shards", 0, "path"), ("shards", 0, "variant"), ("shards", 1, "samples"), ("params",),
     ("source",), ("rejected",), ("variants",), ("format",), ("created",), ("decoded_with_warnings",)]
)
_manifest_change = st.one_of(
    st.tuples(st.just("set"), _paths, _json_values),
    st.tuples(st.just("drop"), _paths),
    st.tuples(st.just("nest"), st.integers(1, 200_000)),
    st.tuples(st.just("cut"), st.integers(0, 2000)),
    st.tuples(st.just("bytes"), st.binary(max_size=200)),
)


def mutate_manifest(text: bytes, change: tuple[Any, ...]) -> bytes:
    kind = change[0]
    if kind == "nest":
        return b"[" * change[1] + b"]" * change[1]
    if kind == "cut":
        return text[: change[1]]
    if kind == "bytes":
        return change[1]
    data = json.loads(text)
    *parents, last = change[1]
    target: Any = data
    for step in parents:
        target = target[step]
    if kind == "set":
        target[last] = change[2]
    else:
        del target[last]
    return json.dumps(data).encode()


@_fuzz_settings(300)
@given(changes=st.lists(_manifest_change, min_size=1, max_size=3))
def test_parse_manifest_returns_a_checked_manifest_or_raises_manifest_error(dataset: Path, changes) -> None:
    text = (dataset / MANIFEST_NAME).read_bytes()
    for change in changes:
        try:
            text = mutate_manifest(text, change)
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            break  # the JSON is no longer a manifest's shape to edit: parse what there is
    try:
        manifest = parse_manifest(text, "fuzz")
    except GpufeedError:
        return
    assert all(0 <= shard.samples <= shard.bytes // 512 for shard in manifest.shards)
    assert 0 <= manifest.samples <= sum(shard.bytes // 512 for shard in manifest.shards)
    assert all(isinstance(name, str) for name in manifest.classes)


# ---------------------------------------------------------------------------
# verify_dataset and a loader epoch over a damaged copy


def _damaged_copy(dataset: Path, folder: Path, changes: list, manifest_change: tuple | None) -> None:
    for index in range(SHARDS):
        data = _shard_bytes(dataset, index)
        (folder / f"shard-{index:06d}.tar").write_bytes(mutate(data, changes) if index == 0 else data)
    text = (dataset / MANIFEST_NAME).read_bytes()
    if manifest_change is not None:
        try:
            text = mutate_manifest(text, manifest_change)
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            pass
    (folder / MANIFEST_NAME).write_bytes(text)


_small_manifest_change = st.none() | st.tuples(st.just("set"), _paths, _json_values)


@_fuzz_settings(120)
@given(changes=mutations, manifest_change=_small_manifest_change)
def test_verify_dataset_reports_or_raises_manifest_error(dataset: Path, changes, manifest_change) -> None:
    with tempfile.TemporaryDirectory() as folder:
        _damaged_copy(dataset, Path(folder), changes, manifest_change)
        try:
            result = verify_dataset(folder)
        except GpufeedError:
            return
        assert result.ok == (not result.problems)


@_fuzz_settings(40)
@given(changes=mutations, manifest_change=_small_manifest_change | st.just(("set", ("shards", 0, "samples"), 40)))
def test_a_loader_epoch_under_skip_delivers_full_batches_or_raises_a_gpufeed_error(dataset: Path, changes, manifest_change) -> None:
    from pipeline.loader import make_loader

    with tempfile.TemporaryDirectory() as folder:
        _damaged_copy(dataset, Path(folder), changes, manifest_change)
        try:
            loader = make_loader(folder, 4, device="cpu", crop=16, num_workers=0, train=False, on_error="skip")
            batches = [(images.shape, labels.tolist()) for images, labels in loader]
        except GpufeedError:
            return
        assert len(batches) == len(loader)
        for number, (shape, labels) in enumerate(batches, 1):
            assert shape[1:] == (3, 16, 16) and (shape[0] == 4 or number == len(batches))  # eval: the last may be short
            assert all(-1 <= label < len(CLASSES) for label in labels)  # -1: a sample without a cls (unlabelled)


# ---------------------------------------------------------------------------
# Peak memory over a hostile corpus, in a child process


def _valid_targets() -> tuple[bytes, dict[str, bytes]]:
    from pipeline.targets import SampleTargets, target_members

    boxes = np.array([[2, 3, 20, 30], [10, 5, 40, 28]], np.float32)
    mask = np.zeros((32, 48), np.uint8)
    mask[3:30, 2:20] = 1
    members = target_members(
        SampleTargets(labels=[0, 2], boxes=boxes, box_labels=np.array([0, 1]), iscrowd=np.array([0, 1]), mask=mask, caption="a cat")
    )
    members["json"] = b'{"columns": {"id": 7}}'
    image = io.BytesIO()
    Image.new("RGB", (48, 32), (90, 20, 200)).save(image, "PNG")
    return image.getvalue(), members


_target_member = st.sampled_from(["boxes.npy", "box_labels.npy", "iscrowd.npy", "labels.json", "mask.png", "txt", "json"])
_target_change = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 4096), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 4096)),
    st.tuples(st.just("bytes"), st.binary(max_size=300)),
    st.tuples(
        st.just("array"),
        st.sampled_from(["float32", "float64", "int64", "uint8", "bool", "complex64", "int8"]),
        st.lists(st.integers(0, 5), min_size=0, max_size=3),
        st.sampled_from([0.0, -1.0, 1e30, float("nan"), float("inf"), 3.0, 2**40]),
    ),
)


def _changed_member(data: bytes, change: tuple[Any, ...]) -> bytes:
    if change[0] == "flip":
        at = change[1] % max(1, len(data))
        return data[:at] + bytes([data[at] ^ change[2]]) + data[at + 1 :] if data else data
    if change[0] == "cut":
        return data[: change[1] % (len(data) + 1)]
    if change[0] == "bytes":
        return change[1]
    _, dtype, shape, value = change
    buffer = io.BytesIO()
    with np.errstate(all="ignore"):
        np.save(buffer, np.full(shape, value).astype(dtype), allow_pickle=False)
    return buffer.getvalue()


@_fuzz_settings(200)
@given(member=_target_member, changes=st.lists(_target_change, min_size=1, max_size=2), flip=st.booleans())
def test_a_sample_s_targets_are_delivered_or_are_sample_damage(member: str, changes, flip: bool) -> None:
    from pipeline.loader.crops import CropSpec
    from pipeline.loader.tasks import TaskPlan, sample_targets

    image, members = _valid_targets()
    for change in changes:
        members[member] = _changed_member(members[member], change)
    for task in ("detection", "segmentation", "multilabel", "captions"):
        for recipe in ("crop", "letterbox", "iou_crop"):
            plan = TaskPlan(task, fields=("json", "boxes.npy"), classes=3)
            try:
                found = sample_targets(plan, "png", image, 11, members, CropSpec(24, True, recipe=recipe), flip)
            except GpufeedError:
                continue
            if task == "detection":
                assert found["boxes"].shape[1:] == (4,) and np.isfinite(found["boxes"]).all()
                assert len(found["boxes"]) == len(found["box_labels"]) and (found["box_labels"] < 3).all()
            if task == "segmentation":
                assert found["mask"].shape == (24, 24)


def write_hostile_corpus(root: Path) -> list[Path]:
    """Datasets a user might be handed: a 1.5 GiB member in a sparse shard, counts that lie, a shard that is a pax bomb."""
    made = []
    sparse = root / "sparse"
    manifest = write_dataset(sparse)
    path = sparse / manifest.shards[0].path
    with open(path, "r+b") as handle:  # a header claiming 1.5 GiB, then a hole: a few KB on disk
        handle.write(tar_header("s0000.jpg", 3 << 29))
        handle.truncate(512 + (3 << 29) + 1024)
    made.append(sparse)
    lying = root / "lying"
    manifest = write_dataset(lying)
    data = json.loads((lying / MANIFEST_NAME).read_text())
    data["shards"][0]["samples"] = data["shards"][0]["bytes"] // 512  # all its bytes could hold, 6 there
    data["samples"] = sum(shard["samples"] for shard in data["shards"])
    (lying / MANIFEST_NAME).write_text(json.dumps(data))
    made.append(lying)
    bomb = root / "bomb"
    manifest = write_dataset(bomb)
    pax = b"".join(pax_header({"size": str((1 << 28) - 1)}) + tar_header(f"k{i}.jpg", 0) for i in range(50))
    (bomb / manifest.shards[1].path).write_bytes(pax + bytes(1024))
    made.append(bomb)
    return made


_CHILD = r"""
import sys
from pipeline.errors import GpufeedError
from pipeline.loader import make_loader
from pipeline.manifest import verify_dataset
for root in sys.argv[1:]:
    try:
        for _ in make_loader(root, 4, device="cpu", crop=16, num_workers=2, train=True, on_error="skip"):
            pass
    except GpufeedError as exc:
        print("loader:", type(exc).__name__, exc)
    print("verify:", verify_dataset(root).problems[:2])
# VmHWM: this process's own peak. ru_maxrss would also count what it was forked from (Linux keeps the
# parent's high-water mark across exec), and a test runner that grew is no property of the loader.
with open("/proc/self/status") as status:
    print("peak_kb", status.read().split("VmHWM:")[1].split()[0])
"""

PEAK_RSS_BOUND_MB = 1536  # the loader and verify over the corpus; one bounded member (256 MiB) at most twice, plus torch


def test_peak_rss_over_a_hostile_corpus_stays_bounded(tmp_path: Path) -> None:
    roots = write_hostile_corpus(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, roots)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "over the bound" in done.stdout + done.stderr, done.stdout  # the 1.5 GiB member: refused, not read
    peak_mb = int(done.stdout.rsplit("peak_kb", 1)[1]) / 1024
    assert peak_mb < PEAK_RSS_BOUND_MB, (peak_mb, done.stdout)
