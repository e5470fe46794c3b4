"""Hostile members of a sample in real shards: the loader's epochs and `loader.dataset[i]` give a gpufeed error or a counted skip.

Each case writes one sample of a small dataset with a member made to
mislead (a mask naming classes the dataset does not have, a PNG whose
chunks break mid-image, a `.npy` whose header claims gigabytes, JSON too
large or nested too deep) and reads it three ways: an epoch with
on_error="skip" (full batches, the sample counted and replaced, nothing of
it delivered), one with on_error="raise" (a SampleError naming the sample,
the member and what is wrong) and `loader.dataset[i]` (a SampleError naming
the shard too). The memory cases run in a child process whose address
space is capped, so an allocation a header asks for shows as the failure.
"""

from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from loader_data import rewrite_shard, shard_samples
from PIL import Image

from pipeline import SampleError, make_loader
from pipeline.io.output import Output
from pipeline.manifest import read_manifest, write_manifest
from pipeline.polygons import MAX_POLYGONS_BYTES
from pipeline.targets import MAX_JSON_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hostile_data import png_chunk  # noqa: E402
from task_data import CLASSES, write_task_dataset  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SHARD = "shard-000000.tar"
AT = 2  # the hostile sample's place in its shard (and in the dataset: shard 0 comes first)
CROP = 32
IGNORE = 255
ADDRESS_SPACE = 3 << 30


@pytest.fixture(scope="module")
def segmentation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_task_dataset(tmp_path_factory.mktemp("seg") / "ds", "segmentation", 16, shard_samples=8, size=(48, 40))


@pytest.fixture(scope="module")
def detection(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Detection samples with a class mask (box class c as c + 1) and an instance map (box n as n + 1)."""
    root = write_task_dataset(tmp_path_factory.mktemp("det") / "ds", "detection", 16, shard_samples=8, size=(48, 40))
    for shard in ("shard-000000.tar", "shard-000001.tar"):
        rewrite_shard(root, shard, lambda _, members: {**members, **_painted(members)})
    output = Output(str(root))
    manifest = read_manifest(output)
    manifest.fields = sorted({*manifest.fields, "mask.png", "instances.png"})
    write_manifest(output, manifest)
    return root


def _painted(members: dict[str, bytes]) -> dict[str, bytes]:
    width, height = picture_size(members)
    labels = np.load(io.BytesIO(members["box_labels.npy"]))
    boxes = np.load(io.BytesIO(members["boxes.npy"])).astype(int)
    classes, instances = np.zeros((height, width), np.uint8), np.zeros((height, width), np.uint8)
    for number, ((x0, y0, x1, y1), label) in enumerate(zip(boxes.tolist(), labels.tolist())):
        classes[y0:y1, x0:x1], instances[y0:y1, x0:x1] = label + 1, number + 1
    return {"mask.png": png(classes), "instances.png": png(instances)}


def picture_size(members: dict[str, bytes]) -> tuple[int, int]:
    return Image.open(io.BytesIO(members["png"])).size


def png(array: np.ndarray, mode: str | None = None, palette: bool = False) -> bytes:
    image = Image.fromarray(array, mode) if mode else Image.fromarray(array)
    if palette:
        image = image.convert("P")
        image.putdata(array.reshape(-1).tolist())
    buffer = io.BytesIO()
    image.save(buffer, "PNG" if mode != "I" else "TIFF")
    return buffer.getvalue()


def broken_png(width: int, height: int) -> bytes:
    """A grey PNG whose header reads and whose image data breaks off into a chunk of no valid type (Pillow: SyntaxError)."""
    data = zlib.compress(b"".join(b"\x00" + bytes(width) for _ in range(height)))
    half = len(data) // 2
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunks = [(b"IHDR", header), (b"IDAT", data[:half]), (b"\x01\x02\x03\x04", data[half:]), (b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(png_chunk(kind, body) for kind, body in chunks)


def with_value(size: tuple[int, int], value: int, dtype: type = np.uint8, ignore: bool = True) -> np.ndarray:
    width, height = size
    mask = np.zeros((height, width), dtype)
    mask[: height // 2, : width // 3] = value
    if ignore:
        mask[-3:, -3:] = IGNORE  # the ignore index beside it is no damage
    return mask


def npy_header(shape: tuple[int, ...], descr: str = "|u1") -> bytes:
    """The header NumPy writes for an array of `shape`, without the data it claims."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}".encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def hostile_copy(dataset: Path, tmp_path: Path, change: Callable[[dict[str, bytes]], dict[str, bytes]]) -> tuple[Path, str]:
    """A copy of the dataset whose sample AT of its first shard has `change` applied; the copy and the sample's key."""
    root = tmp_path / "copy"
    shutil.copytree(dataset, root)
    key = shard_samples(root, SHARD)[AT]["__key__"]
    rewrite_shard(root, SHARD, lambda index, members: change(members) if index == AT else members)
    return root, key


def loader_for(root: Path, **options: object):
    settings: dict = {"device": "cpu", "crop": CROP, "num_workers": 2, "dtype": "uint8", "train": False}
    settings.update(options)
    return make_loader(root, 4, **settings)


def skipped_epoch(root: Path, **options: object) -> list:
    """One epoch under on_error="skip": full batches, the one hostile sample counted and replaced."""
    loader = loader_for(root, **options)
    batches = list(loader)
    assert len(batches) == len(loader) and all(len(batch.keys) == 4 for batch in batches)
    assert (loader.stats.skipped, loader.stats.replaced) == (1, 1)
    return batches


def assert_refused(root: Path, key: str, *said: str, **options: object) -> None:
    """on_error="raise" stops at the sample, and `dataset[AT]` refuses it: both name it and what is wrong."""
    with pytest.raises(SampleError) as raised:
        list(loader_for(root, on_error="raise", **options))
    with pytest.raises(SampleError) as looked:
        loader_for(root).dataset[AT]
    for refused in (raised.value, looked.value):
        message = str(refused)
        assert refused.sample == key and refused.shard.endswith(SHARD) and f"sample {key} of " in message, message
        assert SHARD in message and all(part in message for part in said), message


MASKS = {  # what the mask member holds -> (its bytes for an image of `size`, what the refusal says)
    "palette index 200": (lambda size: png(with_value(size, 200), palette=True), "value 200"),
    "grey value 77": (lambda size: png(with_value(size, 77)), "value 77"),
    "16-bit -1 (65535)": (lambda size: png(with_value(size, 65535, np.uint16)), "value 65535"),
    "32-bit negative": (lambda size: png(with_value(size, -3, np.int32), mode="I"), "value -3"),
    "broken PNG": (lambda size: broken_png(*size), "does not decode"),
}


@pytest.mark.parametrize("case", sorted(MASKS))
def test_a_segmentation_mask_outside_the_classes_or_broken_is_damage(segmentation: Path, tmp_path: Path, case: str) -> None:
    make, said = MASKS[case]
    root, key = hostile_copy(segmentation, tmp_path, lambda m: {**m, "mask.png": make(picture_size(m))})
    for batch in skipped_epoch(root, worker_type="process" if case == "broken PNG" else "thread"):
        assert key not in batch.keys
        values = set(np.unique(batch.masks.numpy()).tolist())
        assert values <= {*range(len(CLASSES)), IGNORE}, values
    assert_refused(root, key, "mask.png", said)


def test_the_ignore_index_and_every_class_are_no_damage(segmentation: Path, tmp_path: Path) -> None:
    root, key = hostile_copy(segmentation, tmp_path, lambda m: {**m, "mask.png": png(with_value(picture_size(m), 4))})
    loader = loader_for(root, on_error="raise")
    assert sum(key in batch.keys for batch in loader) == 1 and loader.stats.skipped == 0
    assert int(loader.dataset[AT].targets["mask"].max()) == IGNORE


@pytest.mark.parametrize("member, value", [("mask.png", len(CLASSES) + 1), ("instances.png", 9)])
def test_a_detection_mask_or_instance_map_past_its_bound_is_damage(detection: Path, tmp_path: Path, member: str, value: int) -> None:
    """A detection mask holds box class + 1 (0 to classes, and the ignore index); an instance map box n + 1."""
    hostile = lambda m: with_value(picture_size(m), value, ignore=member == "mask.png")  # noqa: E731
    root, key = hostile_copy(detection, tmp_path, lambda m: {**m, member: png(hostile(m))})
    for batch in skipped_epoch(root):
        assert key not in batch.keys
        assert set(np.unique(batch.masks.numpy()).tolist()) <= {*range(len(CLASSES) + 1), IGNORE}
    with pytest.raises(SampleError) as raised:
        list(loader_for(root, on_error="raise"))
    message = str(raised.value)
    assert raised.value.sample == key and raised.value.shard.endswith(SHARD), message
    assert f"sample {key} of " in message and f"{member} holds the value {value}, outside 0 to " in message, message


def test_a_clean_detection_dataset_with_masks_is_read_whole(detection: Path) -> None:
    loader = loader_for(detection, on_error="raise")
    batches = list(loader)
    assert len(batches) == 4 and loader.stats.skipped == 0
    painted = {*range(len(CLASSES) + 1), IGNORE}  # the crop's letterbox is the ignore index
    assert all(set(np.unique(batch.masks.numpy()).tolist()) <= painted for batch in batches)


# -- JSON members ----------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
LARGE = b"[" + b"1.5," * (MAX_JSON_BYTES // 4) + b"1.5]"  # just over the bound: 8 million floats


@pytest.mark.parametrize("case", ["deep", "large"])
def test_a_json_member_too_deep_or_too_large_is_damage(segmentation: Path, tmp_path: Path, case: str) -> None:
    data = DEEP if case == "deep" else LARGE
    said = "nests too deep" if case == "deep" else f"over the {MAX_JSON_BYTES} bytes"
    root, key = hostile_copy(segmentation, tmp_path, lambda m: {**m, "json": data})
    for batch in skipped_epoch(root, fields=("json",)):
        assert key not in batch.keys and all(isinstance(meta, dict) for meta in batch.fields["json"])
    assert_refused(root, key, "json", said, fields=("json",))


def test_labels_and_polygons_members_too_deep_or_too_large_are_damage(tmp_path: Path) -> None:
    multilabel = write_task_dataset(tmp_path / "ml", "multilabel", 8, shard_samples=8, size=(48, 40))
    root, key = hostile_copy(multilabel, tmp_path / "a", lambda m: {**m, "labels.json": DEEP})
    skipped_epoch(root)
    with pytest.raises(SampleError, match="labels.json is not JSON that can be read: it nests too deep"):
        list(loader_for(root, on_error="raise"))
    detection = write_task_dataset(tmp_path / "det", "detection", 8, shard_samples=8, size=(48, 40))
    too_long = b" " * MAX_POLYGONS_BYTES + b"[]"
    root, key = hostile_copy(detection, tmp_path / "b", lambda m: {**m, "polygons.json": too_long})
    output = Output(str(root))
    manifest = read_manifest(output)
    manifest.fields = sorted({*manifest.fields, "polygons.json"})
    write_manifest(output, manifest)
    skipped_epoch(root)
    with pytest.raises(SampleError, match=f"polygons.json is {len(too_long)} bytes"):
        list(loader_for(root, on_error="raise"))


def test_a_cls_field_of_thousands_of_digits_is_its_text(segmentation: Path, tmp_path: Path) -> None:
    digits = b"7" * 5000  # past Python's int-string limit
    root, key = hostile_copy(segmentation, tmp_path, lambda m: {**m, "extra.cls": digits})
    values = {k: v for batch in loader_for(root, fields=("key", "extra.cls"), on_error="raise")
              for k, v in zip(batch.keys, batch.fields["extra.cls"])}  # fmt: skip
    assert values[key] == digits.decode() and all(v is None for k, v in values.items() if k != key)


# -- memory: a .npy header that lies -----------------------------------------------

CHILD = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    from pipeline import SampleError, make_loader
    for on_error in ("skip", "raise"):
        loader = make_loader(sys.argv[1], 4, device="cpu", crop=32, num_workers=2, dtype="uint8", train=False,
                             on_error=on_error)
        try:
            batches = list(loader)
            print("EPOCH", len(batches), len(loader), loader.stats.skipped, loader.stats.replaced)
        except SampleError as exc:
            print("REFUSED", exc)
    try:
        loader.dataset[{at}]
    except SampleError as exc:
        print("REFUSED", exc)
    """
)


def run_capped(root: Path) -> list[str]:
    """Epochs under "skip" and "raise", then `dataset[AT]`, in a child process whose address space is capped."""
    script = CHILD.format(cap=ADDRESS_SPACE, at=AT)
    done = subprocess.run(
        [sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=40,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_a_npy_image_whose_header_claims_gigabytes_is_damage_without_the_allocation(segmentation: Path, tmp_path: Path) -> None:
    claimed = (90_000, 100_000)  # 9 * 10**9 uint8 elements: 8.4 GiB, over the child's whole address space
    lying = npy_header(claimed) + bytes(48 * 40)

    def swap(members: dict[str, bytes]) -> dict[str, bytes]:
        return {**{k: v for k, v in members.items() if k != "png"}, "npy": lying}

    root, key = hostile_copy(segmentation, tmp_path, swap)
    skipped, raised, looked = run_capped(root)
    assert skipped.split() == ["EPOCH", "4", "4", "1", "1"], skipped
    assert raised.startswith("REFUSED") and key in raised and SHARD in raised and "header says 9000000000" in raised, raised
    assert looked.startswith("REFUSED") and key in looked and SHARD in looked and "header says 9000000000" in looked, looked
