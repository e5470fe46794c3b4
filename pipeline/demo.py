"""Generate demo datasets: photo-like ImageFolders, and detection, segmentation and caption datasets.

Flat colours decode in a fraction of the time a photograph takes, which would
make every speed figure a lie. These images mix smooth gradients, shapes,
texture and sensor-like noise so that their JPEG entropy (and therefore decode
cost, ~200-350 KB per megapixel at quality 90) is close to real photos.

The detection, segmentation and caption generators (`make_coco_dataset`,
`make_yolo_dataset`, `make_voc_dataset`, `make_segmentation_dataset`,
`make_caption_shards`) draw small images of flat rectangles instead: they are
for checking geometry, so every box and mask is known exactly (`demo_scene`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from .errors import ConfigError

DEFAULT_CLASSES = ("aurora", "canyon", "harbour", "meadow", "orchard", "tundra")


@dataclasses.dataclass(frozen=True)
class DemoDataResult:
    """What `make_demo_dataset` wrote."""

    root: str
    images: int
    classes: tuple[str, ...]
    bytes: int


def make_demo_dataset(
    root: str | os.PathLike[str],
    n: int = 1000,
    *,
    classes: int = 4,
    min_side: int = 800,
    max_side: int = 1600,
    quality: int = 90,
    seed: int = 0,
    workers: int | None = None,
) -> DemoDataResult:
    """Write `n` photo-like JPEGs into `root/<class>/<class>_NNNNNN.jpg`.

    Args:
        root: directory to create (may exist; existing files are overwritten).
        n: number of images.
        classes: number of class folders (at most 6).
        min_side: smallest width/height in pixels.
        max_side: largest width/height in pixels.
        quality: JPEG quality.
        seed: images are a pure function of (seed, index).
        workers: processes (default: available cores).

    Returns:
        A DemoDataResult with the count and total bytes.

    Raises:
        ConfigError: on impossible settings.
    """
    if n < 1:
        raise ConfigError("--n must be at least 1")
    if not 1 <= classes <= len(DEFAULT_CLASSES):
        raise ConfigError(f"--classes must be between 1 and {len(DEFAULT_CLASSES)}")
    if not 16 <= min_side <= max_side:
        raise ConfigError("sizes must satisfy 16 <= min-side <= max-side")
    names = DEFAULT_CLASSES[:classes]
    base = Path(root)
    for name in names:
        (base / name).mkdir(parents=True, exist_ok=True)
    jobs = [(str(base), names, i, min_side, max_side, quality, seed) for i in range(n)]
    workers = workers if workers is not None else len(os.sched_getaffinity(0))
    if workers > 1 and n > 8:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            total = sum(pool.imap_unordered(_write_one, jobs, chunksize=8))
    else:
        total = sum(map(_write_one, jobs))
    return DemoDataResult(str(base), n, names, total)


def _write_one(job: tuple[str, tuple[str, ...], int, int, int, int, int]) -> int:
    from PIL import Image

    root, names, index, min_side, max_side, quality, seed = job
    name = names[index % len(names)]
    pixels = render_photo_like(index, min_side, max_side, seed=seed, tint=index % len(names))
    path = Path(root) / name / f"{name}_{index:06d}.jpg"
    Image.fromarray(pixels).save(path, format="JPEG", quality=quality)
    return path.stat().st_size


def render_photo_like(
    index: int, min_side: int = 800, max_side: int = 1600, *, seed: int = 0, tint: int = 0
) -> np.ndarray:
    """Return an HxWx3 uint8 array that compresses like a photograph.

    Built from C-speed PIL operations (bicubic upscaling of small random
    fields, anti-aliased shapes) so a thousand 1-2 MP images take seconds.
    """
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng([seed, index])
    width = int(rng.integers(min_side, max_side + 1))
    height = int(rng.integers(min_side, max_side + 1))
    # A smooth sky/ground gradient: a 4x4 colour field upscaled bicubically.
    base = rng.uniform(40, 215, (4, 4, 3))
    base[..., tint % 3] += 35
    canvas = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).resize(
        (width, height), Image.Resampling.BICUBIC
    )
    draw = ImageDraw.Draw(canvas, "RGBA")
    for _ in range(int(rng.integers(5, 11))):
        colour = tuple(int(c) for c in rng.integers(10, 245, 3)) + (int(rng.integers(120, 230)),)
        x0, y0 = rng.uniform(-0.1, 0.9) * width, rng.uniform(-0.1, 0.9) * height
        w, h = rng.uniform(0.08, 0.5) * width, rng.uniform(0.08, 0.5) * height
        kind = rng.integers(0, 3)
        if kind == 0:
            draw.ellipse((x0, y0, x0 + w, y0 + h), fill=colour)
        elif kind == 1:
            draw.rectangle((x0, y0, x0 + w, y0 + h), fill=colour)
        else:
            points = [(x0 + rng.uniform(0, w), y0 + rng.uniform(0, h)) for _ in range(5)]
            draw.polygon(points, fill=colour)
    canvas = canvas.filter(ImageFilter.GaussianBlur(1.2))
    image = np.asarray(canvas, dtype=np.int16)
    image = image + _texture(rng, height, width)[..., None]
    image += _grain(rng, height, width)
    return np.clip(image, 0, 255).astype(np.uint8)


def _texture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    # Value noise at a few octaves, smoothly interpolated: foliage, fabric, rock.
    from PIL import Image

    texture = np.zeros((height, width), np.int16)
    for cells, amplitude in ((8, 18), (40, 12), (160, 8)):
        field = rng.integers(0, 256, (cells, cells), dtype=np.uint8)
        up = Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC)
        texture += (np.asarray(up, dtype=np.int16) - 128) * amplitude // 128
    return texture


_GRAIN_BANK: dict[int, np.ndarray] = {}


def _grain(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    # Sensor noise: a random window into a per-process bank of Gaussian noise,
    # so each image gets different grain without drawing millions of normals.
    bank = _GRAIN_BANK.get(0)
    if bank is None:
        bank = np.random.default_rng(1234).normal(0, 4.0, (2048, 2048, 3)).astype(np.int16)
        _GRAIN_BANK[0] = bank
    if height > bank.shape[0] or width > bank.shape[1]:
        reps = (-(-height // bank.shape[0]), -(-width // bank.shape[1]), 1)
        return np.tile(bank, reps)[:height, :width]
    y = int(rng.integers(0, bank.shape[0] - height + 1))
    x = int(rng.integers(0, bank.shape[1] - width + 1))
    return bank[y : y + height, x : x + width]


# -- datasets with targets: detection, segmentation, captions ------------------

OBJECT_CLASSES = ("cat", "dog", "bird", "car", "boat", "tree")
_OBJECT_COLOURS = ((220, 60, 50), (60, 170, 70), (50, 90, 220), (230, 200, 40), (170, 60, 200), (40, 200, 210))


@dataclasses.dataclass(frozen=True)
class DemoScene:
    """What one generated image shows: its size and its rectangles, in drawing order (later on top).

    Attributes:
        width: image width in pixels.
        height: image height in pixels.
        boxes: one (x0, y0, x1, y1) per rectangle, integer pixel edges: the
            rectangle covers columns x0 .. x1 - 1 and rows y0 .. y1 - 1.
        labels: the class index of each rectangle (into the class names).
        crowd: COCO's crowd flag of each rectangle.
    """

    width: int
    height: int
    boxes: tuple[tuple[int, int, int, int], ...]
    labels: tuple[int, ...]
    crowd: tuple[int, ...]


def demo_scene(index: int, *, seed: int = 0, classes: int = 3, min_side: int = 48, max_side: int = 128) -> DemoScene:
    """The scene of image `index`: a pure function of (seed, index), what every generator below draws.

    Tests take the truth from here: the boxes a listing or a shard gives
    back must be these. Every third image of six has no object at all (a
    detection dataset has such images); the rest have one to four.

    Args:
        index: the image's number.
        seed: the dataset's seed.
        classes: how many class names the rectangles are drawn from.
        min_side: smallest width/height.
        max_side: largest width/height.
    """
    rng = np.random.default_rng([seed, index, 7])
    width = int(rng.integers(min_side, max_side + 1))
    height = int(rng.integers(min_side, max_side + 1))
    count = 0 if index % 6 == 5 else int(rng.integers(1, 5))
    boxes, labels, crowd = [], [], []
    for _ in range(count):
        w = int(rng.integers(max(2, width // 8), max(3, width // 2)))
        h = int(rng.integers(max(2, height // 8), max(3, height // 2)))
        x0 = int(rng.integers(0, width - w + 1))
        y0 = int(rng.integers(0, height - h + 1))
        boxes.append((x0, y0, x0 + w, y0 + h))
        labels.append(int(rng.integers(0, classes)))
        crowd.append(int(rng.random() < 0.1))
    return DemoScene(width, height, tuple(boxes), tuple(labels), tuple(crowd))


def demo_mask(scene: DemoScene) -> np.ndarray:
    """The class-index mask (H, W) uint8 of a scene: 0 is background, rectangle of class c is c + 1 (later on top)."""
    mask = np.zeros((scene.height, scene.width), np.uint8)
    for (x0, y0, x1, y1), label in zip(scene.boxes, scene.labels):
        mask[y0:y1, x0:x1] = label + 1
    return mask


def render_scene(scene: DemoScene, index: int, *, seed: int = 0) -> np.ndarray:
    """The HxWx3 uint8 pixels of a scene: a soft noisy background and each rectangle in its class colour."""
    rng = np.random.default_rng([seed, index, 11])
    ys = np.linspace(0, 1, scene.height, dtype=np.float32)[:, None, None]
    xs = np.linspace(0, 1, scene.width, dtype=np.float32)[None, :, None]
    low, high = rng.uniform(60, 140, 3), rng.uniform(100, 200, 3)
    pixels = low + (high - low) * (0.5 * xs + 0.5 * ys) + rng.normal(0, 6, (scene.height, scene.width, 3))
    for (x0, y0, x1, y1), label in zip(scene.boxes, scene.labels):
        pixels[y0:y1, x0:x1] = _OBJECT_COLOURS[label % len(_OBJECT_COLOURS)]
    return np.clip(pixels, 0, 255).astype(np.uint8)


def _check_scene_args(images: int, classes: int, min_side: int = 48, max_side: int = 128) -> None:
    if images < 1:
        raise ConfigError("images must be at least 1")
    if not 8 <= min_side <= max_side:
        raise ConfigError("min_side must be at least 8 and at most max_side")
    if not 1 <= classes <= len(OBJECT_CLASSES):
        raise ConfigError(f"classes must be between 1 and {len(OBJECT_CLASSES)}")


def _save_jpeg(pixels: np.ndarray, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG", quality=90)


def make_coco_dataset(
    root: str | os.PathLike[str],
    images: int = 100,
    *,
    classes: int = 3,
    split: str = "train",
    seed: int = 0,
    min_side: int = 48,
    max_side: int = 128,
    segmentation: str | None = "polygon",
) -> str:
    """Write a COCO detection dataset in COCO's own layout and return the path of its instances JSON.

    Layout: `root/<split>/<NNNNNN>.jpg` and `root/annotations/instances_<split>.json`.
    Category ids are 1, 3, 5, ... (COCO's ids have gaps too), named from
    `OBJECT_CLASSES`; each rectangle of `demo_scene(i)` is one annotation with
    its bbox [x, y, w, h], area, iscrowd and its shape (`segmentation`).
    Images without objects have no annotations.

    Args:
        root: folder to write (may exist).
        images: how many images.
        classes: how many categories (at most 6).
        split: the split name in the folder and file names.
        seed: images and annotations are a pure function of (seed, index).
        min_side: smallest image width/height in pixels (`demo_scene`).
        max_side: largest image width/height in pixels.
        segmentation: each rectangle's shape: "polygon" (its four corners),
            "rle" (uncompressed RLE, {"counts": [...], "size": [h, w]}),
            "compressed" (COCO's compressed RLE string), or None (no
            `segmentation`: boxes only). Each covers exactly the pixels the
            rectangle is drawn on.

    Raises:
        ConfigError: on impossible settings.
    """
    _check_scene_args(images, classes, min_side, max_side)
    if segmentation not in ("polygon", "rle", "compressed", None):
        raise ConfigError(f"segmentation must be 'polygon', 'rle', 'compressed' or None, not {segmentation!r}")
    base = Path(root)
    coco: dict[str, list[dict[str, object]]] = {
        "images": [],
        "annotations": [],
        "categories": [{"id": 2 * c + 1, "name": OBJECT_CLASSES[c], "supercategory": "thing"} for c in range(classes)],
    }
    for index in range(images):
        scene = demo_scene(index, seed=seed, classes=classes, min_side=min_side, max_side=max_side)
        name = f"{index:06d}.jpg"
        _save_jpeg(render_scene(scene, index, seed=seed), base / split / name)
        coco["images"].append({"id": index + 1, "file_name": name, "width": scene.width, "height": scene.height})
        for (x0, y0, x1, y1), label, crowd in zip(scene.boxes, scene.labels, scene.crowd):
            annotation: dict[str, object] = {
                "id": len(coco["annotations"]) + 1,
                "image_id": index + 1,
                "category_id": 2 * label + 1,
                "bbox": [x0, y0, x1 - x0, y1 - y0],
                "area": (x1 - x0) * (y1 - y0),
                "iscrowd": crowd,
            }
            if segmentation is not None:
                annotation["segmentation"] = _demo_shape(segmentation, scene, (x0, y0, x1, y1))
            coco["annotations"].append(annotation)
    path = base / "annotations" / f"instances_{split}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(coco), encoding="utf-8")
    return str(path)


def _demo_shape(kind: str, scene: DemoScene, box: tuple[int, int, int, int]) -> object:
    x0, y0, x1, y1 = box
    if kind == "polygon":
        return [[x0, y0, x1, y0, x1, y1, x0, y1]]
    region = np.zeros((scene.height, scene.width), np.bool_)
    region[y0:y1, x0:x1] = True
    counts = rle_counts(region)
    return {"counts": rle_string(counts) if kind == "compressed" else counts, "size": [scene.height, scene.width]}


def rle_counts(region: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE counts of an (H, W) bool mask: run lengths in column-major order, zeros first."""
    flat = np.asarray(region, np.bool_).T.reshape(-1)
    edges = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate([[0], edges, [flat.size]])
    runs = np.diff(bounds).tolist()
    return ([0] + runs) if flat.size and flat[0] else runs


def rle_string(counts: list[int]) -> str:
    """COCO's compressed RLE string of run lengths (pycocotools' `rleToString`)."""
    out = []
    for i, count in enumerate(counts):
        value = count - counts[i - 2] if i > 2 else count
        more = True
        while more:
            char = value & 0x1F
            value >>= 5
            more = value != -1 if char & 0x10 else value != 0
            out.append(chr((char | 0x20 if more else char) + 48))
    return "".join(out)


def make_yolo_dataset(
    root: str | os.PathLike[str],
    images: int = 100,
    *,
    classes: int = 3,
    splits: tuple[str, ...] = ("train", "val"),
    names_as_dict: bool = False,
    seed: int = 0,
    min_side: int = 48,
    max_side: int = 128,
) -> str:
    """Write a YOLO (Ultralytics) detection dataset and return its root.

    Layout: `root/data.yaml` (`names:` as a list, or as {id: name} with
    `names_as_dict`), `root/images/<split>/<NNNNNN>.jpg` and
    `root/labels/<split>/<NNNNNN>.txt`, one `cls cx cy w h` line per
    rectangle, normalised to the image size. Image i goes to split
    `splits[i % len(splits)]`; an image without objects has no label file.

    Args:
        root: folder to write (may exist).
        images: how many images.
        classes: how many class names (at most 6).
        splits: split folder names; () writes images/ and labels/ without split folders.
        names_as_dict: write `names` as a mapping instead of a list.
        seed: a pure function of (seed, index).
        min_side: smallest image width/height in pixels (`demo_scene`).
        max_side: largest image width/height in pixels.

    Raises:
        ConfigError: on impossible settings.
    """
    _check_scene_args(images, classes, min_side, max_side)
    base = Path(root)
    for index in range(images):
        scene = demo_scene(index, seed=seed, classes=classes, min_side=min_side, max_side=max_side)
        folder = splits[index % len(splits)] if splits else ""
        stem = f"{index:06d}"
        _save_jpeg(render_scene(scene, index, seed=seed), base / "images" / folder / f"{stem}.jpg")
        if not scene.boxes:
            continue
        lines = []
        for (x0, y0, x1, y1), label in zip(scene.boxes, scene.labels):
            w, h = scene.width, scene.height
            lines.append(f"{label} {(x0 + x1) / 2 / w!r} {(y0 + y1) / 2 / h!r} {(x1 - x0) / w!r} {(y1 - y0) / h!r}")
        label_path = base / "labels" / folder / f"{stem}.txt"
        label_path.parent.mkdir(parents=True, exist_ok=True)
        label_path.write_text("\n".join(lines) + "\n", encoding="ascii")
    names = OBJECT_CLASSES[:classes]
    if names_as_dict:
        names_yaml = "names:\n" + "".join(f"  {i}: {name}\n" for i, name in enumerate(names))
    else:
        names_yaml = f"names: [{', '.join(names)}]\n"
    split_yaml = "".join(f"{split}: images/{split}\n" for split in splits) or "train: images\n"
    (base / "data.yaml").write_text(f"path: .\n{split_yaml}nc: {classes}\n{names_yaml}", encoding="utf-8")
    return str(base)


def make_voc_dataset(
    root: str | os.PathLike[str], images: int = 100, *, classes: int = 3, seed: int = 0, min_side: int = 48,
    max_side: int = 128,
) -> str:
    """Write a Pascal VOC detection dataset and return its root.

    Layout: `root/JPEGImages/<NNNNNN>.jpg`, `root/Annotations/<NNNNNN>.xml`
    and `root/ImageSets/Main/trainval.txt`. VOC's boxes are 1-based and
    inclusive: a rectangle covering columns x0 .. x1 - 1 is written
    xmin = x0 + 1, xmax = x1. COCO's crowd flag is written as <difficult>.

    Args:
        root: folder to write (may exist).
        images: how many images.
        classes: how many class names (at most 6).
        seed: a pure function of (seed, index).
        min_side: smallest image width/height in pixels (`demo_scene`).
        max_side: largest image width/height in pixels.

    Raises:
        ConfigError: on impossible settings.
    """
    _check_scene_args(images, classes, min_side, max_side)
    base = Path(root)
    (base / "Annotations").mkdir(parents=True, exist_ok=True)
    stems = []
    for index in range(images):
        scene = demo_scene(index, seed=seed, classes=classes, min_side=min_side, max_side=max_side)
        stem = f"{index:06d}"
        stems.append(stem)
        _save_jpeg(render_scene(scene, index, seed=seed), base / "JPEGImages" / f"{stem}.jpg")
        objects = "".join(
            f"<object><name>{OBJECT_CLASSES[label]}</name><pose>Unspecified</pose><truncated>0</truncated>"
            f"<difficult>{crowd}</difficult><bndbox><xmin>{x0 + 1}</xmin><ymin>{y0 + 1}</ymin>"
            f"<xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
            for (x0, y0, x1, y1), label, crowd in zip(scene.boxes, scene.labels, scene.crowd)
        )
        xml = (
            f"<annotation><folder>VOC</folder><filename>{stem}.jpg</filename><size><width>{scene.width}</width>"
            f"<height>{scene.height}</height><depth>3</depth></size><segmented>0</segmented>{objects}</annotation>\n"
        )
        (base / "Annotations" / f"{stem}.xml").write_text(xml, encoding="utf-8")
    (base / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
    (base / "ImageSets" / "Main" / "trainval.txt").write_text("".join(f"{s}\n" for s in stems), encoding="ascii")
    return str(base)


def make_segmentation_dataset(
    root: str | os.PathLike[str],
    images: int = 100,
    *,
    classes: int = 3,
    layout: str = "masks",
    palette: bool = False,
    seed: int = 0,
    min_side: int = 48,
    max_side: int = 128,
) -> str:
    """Write a semantic segmentation dataset (image + class-index mask PNG) and return its root.

    The mask of image i is `demo_mask(demo_scene(i))`: 0 is background, a
    rectangle of class c is c + 1, so `root/classes.txt` lists "background"
    and then the class names.

    Args:
        root: folder to write (may exist).
        images: how many images.
        classes: how many object classes (at most 6).
        layout: "masks" (`images/<NNNNNN>.jpg` + `masks/<NNNNNN>.png`) or
            "voc" (`JPEGImages/` + `SegmentationClass/`).
        palette: write the masks as palette ("P") PNGs, as VOC does, instead of grey ("L").
        seed: a pure function of (seed, index).
        min_side: smallest image width/height in pixels (`demo_scene`).
        max_side: largest image width/height in pixels.

    Raises:
        ConfigError: on impossible settings.
    """
    from PIL import Image

    _check_scene_args(images, classes, min_side, max_side)
    if layout not in ("masks", "voc"):
        raise ConfigError(f"layout must be 'masks' or 'voc', not {layout!r}")
    base = Path(root)
    image_dir, mask_dir = ("images", "masks") if layout == "masks" else ("JPEGImages", "SegmentationClass")
    (base / mask_dir).mkdir(parents=True, exist_ok=True)
    for index in range(images):
        scene = demo_scene(index, seed=seed, classes=classes, min_side=min_side, max_side=max_side)
        stem = f"{index:06d}"
        _save_jpeg(render_scene(scene, index, seed=seed), base / image_dir / f"{stem}.jpg")
        mask = Image.fromarray(demo_mask(scene), mode="L")
        if palette:
            mask = mask.convert("P")  # indices kept; PIL gives P mode a grey palette
            mask.putpalette([v for c in ((0, 0, 0),) + _OBJECT_COLOURS for v in c] + [224, 224, 192] * 249)
        mask.save(base / mask_dir / f"{stem}.png", format="PNG")
    (base / "classes.txt").write_text("background\n" + "".join(f"{n}\n" for n in OBJECT_CLASSES[:classes]), encoding="utf-8")
    return str(base)


def make_caption_shards(
    root: str | os.PathLike[str],
    images: int = 100,
    *,
    per_shard: int = 50,
    classes: int = 3,
    seed: int = 0,
    min_side: int = 48,
    max_side: int = 128,
) -> str:
    """Write img2dataset-style WebDataset shards (jpg + txt + json, no cls) and return their brace pattern.

    Layout: `root/00000.tar`, `root/00001.tar`, ... each beside an
    `NNNNN_stats.json` and an `NNNNN.parquet` placeholder as img2dataset
    leaves them. Sample i has key `SSSSSIIII` (shard, then index in the
    shard, img2dataset's form), caption `demo_caption(demo_scene(i))` and a
    json of {"url", "key", "status", "caption", "width", "height"}.

    Args:
        root: folder to write (may exist).
        images: how many samples.
        per_shard: samples per shard.
        classes: how many class names the captions use (at most 6).
        seed: a pure function of (seed, index).
        min_side: smallest image width/height in pixels (`demo_scene`).
        max_side: largest image width/height in pixels.

    Returns:
        The shards as a brace pattern, e.g. `root/{00000..00001}.tar`.

    Raises:
        ConfigError: on impossible settings.
    """
    import io as _io

    from PIL import Image

    from .io.tar import sample_tar_bytes

    _check_scene_args(images, classes, min_side, max_side)
    if per_shard < 1:
        raise ConfigError("per_shard must be at least 1")
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    shards = -(-images // per_shard)
    for shard in range(shards):
        parts = []
        for index in range(shard * per_shard, min(images, (shard + 1) * per_shard)):
            scene = demo_scene(index, seed=seed, classes=classes, min_side=min_side, max_side=max_side)
            buffer = _io.BytesIO()
            Image.fromarray(render_scene(scene, index, seed=seed)).save(buffer, format="JPEG", quality=90)
            key = f"{shard:05d}{index - shard * per_shard:04d}"
            caption = demo_caption(scene)
            meta = {"url": f"https://example.com/{key}.jpg", "key": key, "status": "success", "caption": caption,
                    "width": scene.width, "height": scene.height}
            parts.append(sample_tar_bytes(key, {"jpg": buffer.getvalue(), "txt": caption.encode("utf-8"),
                                                "json": json.dumps(meta).encode("utf-8")}))
        blob = b"".join(parts) + bytes(1024)
        (base / f"{shard:05d}.tar").write_bytes(blob + bytes(-len(blob) % 10240))
        (base / f"{shard:05d}_stats.json").write_text(json.dumps({"count": len(parts)}), encoding="utf-8")
        (base / f"{shard:05d}.parquet").write_bytes(b"PAR1")
    return str(base / f"{{00000..{shards - 1:05d}}}.tar")


def demo_caption(scene: DemoScene) -> str:
    """The caption of a scene: its rectangles' colours and classes, in words."""
    if not scene.boxes:
        return "an empty picture"
    words = [f"a {_COLOUR_NAMES[label % len(_COLOUR_NAMES)]} {OBJECT_CLASSES[label]}" for label in scene.labels]
    return "a picture of " + ", ".join(words)


_COLOUR_NAMES = ("red", "green", "blue", "yellow", "purple", "cyan")
