"""recipe="yolo" with decoder="nvjpeg": the workers' plans, rendered on the device from pictures decoded once each.

Run here on the CPU with PIL standing in for nvjpeg: a decode piece's
plan-only pass must give the targets its rendering pass gives (the same
boxes, polygons and HSV gains) plus each output's plan and the batch
positions of its pictures; `render_mosaics` must render those plans to
the CPU path's pixels (30 dB or better), decode each picture once, and
fail exactly the outputs that show a picture that decodes nowhere; and the
loader itself, with decoder="nvjpeg" on the CPU and PIL in nvjpeg's place,
must deliver the CPU path's boxes and pixels (HSV applied on the batch),
a refused picture's outputs stood in for. On a CUDA machine the same loader
runs end to end with nvjpeg (`cuda` mark).
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import red_shapes
import torch
from red_shapes import graded, write_source

from pipeline import make_loader
from pipeline.errors import DecodeError
from pipeline.loader.crops import CropSpec
from pipeline.loader.gpu_mosaic import cpu_decode, render_mosaics
from pipeline.loader.mosaic_piece import HSV_GAINS, MOSAIC_PLAN
from pipeline.loader.pieces import TaskWork, decode_task_chunk
from pipeline.loader.tasks import task_plan

SIZE = 160


def triangles(rng: np.random.Generator, width: int, height: int) -> list[np.ndarray]:
    """A triangle in each half of the picture."""
    found = []
    for label in range(2):
        x0, y0 = (0.1 + 0.45 * label) * width, rng.uniform(0.1, 0.4) * height
        found.append(np.array([(x0, y0), (x0 + 0.3 * width, y0 + 0.1 * height), (x0 + 0.1 * width, y0 + 0.45 * height)]))
    return found


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("gpu-mosaic")
    source = write_source(base / "source", triangles, count=12, seed=5, names=("left", "right"), sides=(120, 260),
                          ground=graded, suffix="jpg")  # fmt: skip
    return red_shapes.prepared(source, base / "out", 200)


def samples(prepared: Path) -> tuple[list[tuple[str, bytes, int]], list[dict[str, bytes]], list[str]]:
    """The shard's samples as a decode piece gets them: (extension, bytes, seed), the kept members, the keys."""
    members: dict[str, dict[str, bytes]] = {}
    for shard in sorted(prepared.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
    keys = sorted(members)
    items = [("jpg", members[key]["jpg"], 1000 + n) for n, key in enumerate(keys)]
    extras = [{ext: data for ext, data in members[key].items() if ext != "jpg"} for key in keys]
    return items, extras, keys


def pieces(prepared: Path, pixels: bool, hyp: tuple = ()) -> tuple[np.ndarray, dict, list]:
    items, extras, keys = samples(prepared)
    plan = task_plan("detection", (), "detection", 2, None, 0.25, None, "thread", ("boxes.npy", "polygons.json"))
    assert plan is not None
    crop = CropSpec(SIZE, True, (0.08, 1.0), (0.75, 4 / 3), 0.875, "region", recipe="yolo", hyp=hyp, hsv_in_workers=False)
    ring = np.zeros((1, len(items), 3, SIZE, SIZE), np.uint8)
    work = TaskWork(plan, extras, keys, [False] * len(items), pixels)
    result = decode_task_chunk(work, ring, 0, 0, items, crop)
    assert not result.failures
    return ring[0], result.targets, items


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    error = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if error == 0 else 10 * np.log10(255.0**2 / error)


def pil_decode(calls: list[int]):
    def decode(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
        calls.append(len(datas))
        return [cpu_decode(data, device) for data in datas]

    return decode


def test_the_plan_only_pass_gives_the_rendering_pass_targets_and_each_outputs_plan(prepared: Path) -> None:
    _, rendered, _ = pieces(prepared, True)
    _, planned, items = pieces(prepared, False)
    assert sorted(planned) == sorted(rendered) == list(range(len(items)))
    for position, targets in planned.items():
        made, shown = targets.pop(MOSAIC_PLAN)
        assert shown[0] == position and all(0 <= p < len(items) for p in shown) and len(shown) == len(made.tiles)
        assert np.array_equal(made.boxes, targets["boxes"])
        assert np.array_equal(targets["boxes"], rendered[position]["boxes"])
        assert targets[HSV_GAINS] == rendered[position][HSV_GAINS]
        assert [[p.tolist() for p in parts] for parts in targets["polygons"]] == \
            [[p.tolist() for p in parts] for parts in rendered[position]["polygons"]]  # fmt: skip


@pytest.mark.parametrize("hyp", [(), (("degrees", 20.0), ("copy_paste", 1.0))], ids=["defaults", "rotated_copy_paste"])
def test_the_device_renders_the_workers_plans_to_the_cpu_paths_pixels(prepared: Path, hyp: tuple) -> None:
    cpu, _, _ = pieces(prepared, True, hyp)
    _, planned, items = pieces(prepared, False, hyp)
    out = torch.zeros((len(items), 3, SIZE, SIZE), dtype=torch.uint8)
    calls: list[int] = []
    pictures = {p for targets in planned.values() for p in targets[MOSAIC_PLAN][1]}
    assert render_mosaics(items, planned, out, pil_decode(calls)) == []
    assert calls == [len(pictures)]  # one decode call, each picture once
    assert all(MOSAIC_PLAN not in targets for targets in planned.values())  # taken off before delivery
    figures = [psnr(out[position].numpy(), cpu[position]) for position in range(len(items))]
    assert min(figures) >= 30.0, [round(f, 1) for f in figures]


def test_a_picture_that_decodes_nowhere_fails_the_outputs_that_show_it(prepared: Path) -> None:
    _, planned, items = pieces(prepared, False)
    shows = {position: set(targets[MOSAIC_PLAN][1]) for position, targets in planned.items()}
    broken = 3
    items = [(ext, b"not a jpeg" if position == broken else data, seed) for position, (ext, data, seed) in enumerate(items)]
    out = torch.zeros((len(items), 3, SIZE, SIZE), dtype=torch.uint8)

    def decode(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
        return [None if data == b"not a jpeg" else cpu_decode(data, device) for data in datas]

    failures = render_mosaics(items, planned, out, decode)
    assert sorted(position for position, _ in failures) == sorted(p for p, shown in shows.items() if broken in shown)
    assert all("not an image" in reason for _, reason in failures)
    for position, shown in shows.items():
        assert bool(out[position].any()) == (broken not in shown)


def test_nvjpeg_is_refused_for_yolo_validation(prepared: Path) -> None:
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="eval mode"):
        make_loader(str(prepared), 4, device="cpu", crop=SIZE, recipe="yolo", train=False, decoder="nvjpeg")


def test_the_loaders_nvjpeg_path_runs_end_to_end_with_pil_in_nvjpegs_place(
    prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's own glue (`DeviceFinish._gpu_mosaics`: the workers' plans, one decode call per batch, the
    render, the HSV gains, a damaged sample's stand-in) on the CPU, PIL standing in for nvjpeg."""
    from pipeline.loader import gpu_decode, gpu_mosaic

    calls: list[int] = []
    monkeypatch.setattr(gpu_decode, "check_gpu_decode", lambda device: None)
    monkeypatch.setattr(gpu_mosaic, "nvjpeg_decode", pil_decode(calls))
    for hyp in ({"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}, {}):
        planned = make_loader(str(prepared), 4, device="cpu", crop=SIZE, num_workers=2, dtype="uint8",
                              recipe="yolo", seed=3, hyp=hyp, decoder="nvjpeg")  # fmt: skip
        rendered = make_loader(str(prepared), 4, device="cpu", crop=SIZE, num_workers=2, dtype="uint8",
                               recipe="yolo", seed=3, hyp=hyp)  # fmt: skip
        count = 0
        for ours, theirs in zip(planned, rendered):
            assert all(torch.equal(a, b) for a, b in zip(ours.boxes, theirs.boxes))
            figures = [psnr(a.numpy(), b.numpy()) for a, b in zip(ours.images, theirs.images)]
            assert min(figures) >= (30.0 if not hyp else 28.0), figures  # HSV: torch's on the batch, native's per image
            count += 1
        assert count == 3 and len(calls) >= count
    calls.clear()
    broken = []

    def decode(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
        calls.append(len(datas))
        broken.append(datas[0])
        return [None if data is broken[0] else cpu_decode(data, device) for data in datas]

    monkeypatch.setattr(gpu_mosaic, "nvjpeg_decode", decode)
    monkeypatch.setattr(gpu_mosaic, "cpu_decode", lambda *_: (_ for _ in ()).throw(DecodeError("refused")))
    damaged = make_loader(str(prepared), 4, device="cpu", crop=SIZE, num_workers=2, dtype="uint8", recipe="yolo",
                          seed=3, decoder="nvjpeg")  # fmt: skip
    batches = list(damaged)
    assert len(batches) == 3 and all(len(batch.images) == 4 for batch in batches)
    assert damaged.stats.replaced >= 1  # the outputs showing a refused picture were stood in for, on the CPU


@pytest.mark.cuda
def test_yolo_batches_render_on_the_gpu_from_nvjpeg(prepared: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    hyp = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}
    on_gpu = make_loader(str(prepared), 4, device="cuda", crop=SIZE, num_workers=2, dtype="uint8", recipe="yolo",
                         seed=3, hyp=hyp, decoder="nvjpeg")  # fmt: skip
    on_cpu = make_loader(str(prepared), 4, device="cpu", crop=SIZE, num_workers=2, dtype="uint8", recipe="yolo",
                         seed=3, hyp=hyp)  # fmt: skip
    for ours, theirs in zip(on_gpu, on_cpu):
        assert ours.images.is_cuda
        assert all(torch.equal(a.cpu(), b) for a, b in zip(ours.boxes, theirs.boxes))
        figures = [psnr(a.cpu().numpy(), b.numpy()) for a, b in zip(ours.images, theirs.images)]
        assert min(figures) >= 28.0, figures  # nvjpeg's IDCT and upsampling differ from libjpeg-turbo's a little
