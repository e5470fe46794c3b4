"""Prepared boxes and masks against the real transforms.v2, on JPEGs of odd sizes with every EXIF orientation.

What a user of torchvision would write for the same job: PIL opens the file,
`ImageOps.exif_transpose` stands it up, then `v2.Resize(S)` (and
`v2.CenterCrop(S)` for `--mode center-crop`) on `tv_tensors.BoundingBoxes` and
`tv_tensors.Mask`. gpufeed's prepare must give the same boxes (within 0.5 px)
and the same masks (exactly). v2 runs in the cached torchvision venv
(`extra_venvs`); the files are written here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from extra_venvs import venv_python
from PIL import Image
from test_transforms_v2 import TORCHVISION

from pipeline import PrepareSpec, ResizeSpec, prepare_dataset
from pipeline.targets import orient_boxes, orient_mask

SIZE = 64
SHAPES = [(203, 151), (151, 97)]  # odd sizes; stored width x height
V2_SCRIPT = r"""
import json, sys
import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision import tv_tensors
from torchvision.transforms import v2

answers = []
for case in json.load(sys.stdin):
    image = ImageOps.exif_transpose(Image.open(case["image"]))
    width, height = image.size
    ops = [v2.Resize(case["size"])] + ([v2.CenterCrop(case["size"])] if case["mode"] == "center-crop" else [])
    pixels = tv_tensors.Image(torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1))
    boxes = tv_tensors.BoundingBoxes(case["boxes"], format="XYXY", canvas_size=(height, width))
    mask = tv_tensors.Mask(torch.from_numpy(np.load(case["mask"])))
    out_pixels, out_boxes, out_mask = v2.Compose(ops)(pixels, boxes, mask)
    np.save(case["mask_out"], out_mask.numpy())
    answers.append({"boxes": out_boxes.tolist(), "size": [out_pixels.shape[2], out_pixels.shape[1]]})
print(json.dumps(answers))
"""


def write_case(folder: Path, stem: str, stored: tuple[int, int], orientation: int) -> tuple[Path, list[list[float]], np.ndarray]:
    """A JPEG stored `stored` with EXIF `orientation`, boxes in its upright pixels, and its mask (upright, 1-px stripes)."""
    width, height = stored
    exif = Image.Exif()
    exif[0x0112] = orientation
    pixels = (np.random.default_rng(orientation).integers(0, 255, (height, width, 3))).astype(np.uint8)
    path = folder / f"{stem}.jpg"
    Image.fromarray(pixels).save(path, "JPEG", quality=90, exif=exif)
    upright = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    uw, uh = upright
    boxes = [
        [10.0, 12.0, 70.5, 60.25],  # a box inside
        [0.0, 0.0, 7.0, float(uh)],  # touching the left, top and bottom edges
        [uw - 2.0, uh - 3.0, float(uw), float(uh)],  # tiny, in the corner
        [uw / 2 - 1, uh / 2 - 1, uw / 2 + 1, uh / 2 + 1],  # tiny, in the middle
    ]
    mask = np.zeros((uh, uw), np.uint8)
    mask[:, ::2] = 1  # 1-px stripes: any half-pixel slip of the sampling shows
    mask[::3, :] = 2
    return path, boxes, mask


def stored_boxes(boxes: list[list[float]], orientation: int, upright: tuple[int, int]) -> list[list[float]]:
    """The boxes in the stored file's pixels (COCO with its stored size declared): the upright ones turned back."""
    back = {6: 8, 8: 6}.get(orientation, orientation)
    return orient_boxes(np.array(boxes, np.float64), back, *upright).tolist()


@pytest.mark.parametrize("mode", ["shorter", "center-crop"])
def test_prepared_boxes_and_masks_equal_v2(tmp_path: Path, mode: str) -> None:
    python = venv_python("torchvision", TORCHVISION)
    src = tmp_path / "coco"
    src.mkdir()
    (tmp_path / "masks").mkdir()
    images, annotations, cases, masks = [], [], [], {}
    for number, (stored, orientation) in enumerate((s, o) for s in SHAPES for o in range(1, 9)):
        stem = f"{number:03d}"
        path, boxes, mask = write_case(src, stem, stored, orientation)
        upright = (mask.shape[1], mask.shape[0])
        # Both frames a tool may write, each with its own declared size; where the sizes cannot tell
        # (orientations 1-4 keep the size) the boxes are upright, label_frame's default.
        in_stored = orientation >= 5 and number % 2 == 1
        declared = stored if in_stored else upright
        in_file = stored_boxes(boxes, orientation, upright) if in_stored else boxes
        images.append({"id": number, "file_name": path.name, "width": declared[0], "height": declared[1]})
        for k, (x0, y0, x1, y1) in enumerate(in_file):
            annotations.append({"id": number * 10 + k, "image_id": number, "category_id": 1, "iscrowd": 0,
                                "bbox": [x0, y0, x1 - x0, y1 - y0]})  # fmt: skip
        np.save(tmp_path / "masks" / f"{stem}.npy", mask)
        masks[path.name] = mask
        cases.append({"image": str(path), "boxes": boxes, "mask": str(tmp_path / "masks" / f"{stem}.npy"),
                      "mask_out": str(tmp_path / "masks" / f"{stem}-v2.npy"), "mode": mode, "size": SIZE})  # fmt: skip
    coco = {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}]}
    (src / "instances.json").write_text(json.dumps(coco))
    done = subprocess.run([str(python), "-c", V2_SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout)
    out = tmp_path / "out"
    spec = PrepareSpec(str(src / "instances.json"), str(out), resize=ResizeSpec(size=SIZE, mode=mode), min_visible=0.0)
    prepare_dataset(spec, workers=0)
    samples = _samples(out)
    for case, answer in zip(cases, answers):
        name = Path(case["image"]).name
        sample = samples[name]
        assert list(sample["size"]) == answer["size"], name
        want = np.array(answer["boxes"], np.float64)
        kept = want[(want[:, 2] > want[:, 0]) & (want[:, 3] > want[:, 1])]  # v2 keeps degenerate boxes; we drop them
        got = np.sort(sample["boxes"], axis=0)
        assert got.shape == kept.shape and np.abs(got - np.sort(kept, axis=0)).max() < 0.5, (name, got, kept)
    # The same pictures as a segmentation folder, each mask stored as its image is (turned back from upright):
    # the prepared masks are v2's, pixel for pixel.
    seg = tmp_path / "seg"
    (seg / "images").mkdir(parents=True)
    (seg / "masks").mkdir()
    for case in cases:
        name = Path(case["image"]).name
        (seg / "images" / name).write_bytes(Path(case["image"]).read_bytes())
        orientation = Image.open(case["image"]).getexif().get(0x0112, 1)
        back = {6: 8, 8: 6}.get(orientation, orientation)
        Image.fromarray(orient_mask(masks[name], back)).save(seg / "masks" / f"{Path(name).stem}.png")
    prepare_dataset(PrepareSpec(str(seg), str(tmp_path / "seg-out"), resize=ResizeSpec(size=SIZE, mode=mode)), workers=0)
    prepared = _samples(tmp_path / "seg-out")
    for case in cases:
        name = Path(case["image"]).name
        np.testing.assert_array_equal(prepared[name]["mask"], np.load(case["mask_out"]), err_msg=f"{name} ({mode})")


def _samples(out: Path) -> dict[str, dict]:
    import io
    import tarfile

    found: dict[str, dict] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
        for parts in members.values():
            meta = json.loads(parts["json"])
            found[Path(meta["source"]).name] = {
                "size": meta["size"],
                "boxes": np.load(io.BytesIO(parts["boxes.npy"])).astype(np.float64) if "boxes.npy" in parts else None,
                "mask": np.asarray(Image.open(io.BytesIO(parts["mask.png"]))) if "mask.png" in parts else None,
            }
    return found
