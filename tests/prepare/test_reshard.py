"""`pipeline.prepare.reshard`: re-pack without decoding, atomic version swaps, re-augment with a new seed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.demo import make_demo_dataset
from pipeline.errors import ConfigError, JobConflictError, ManifestError
from pipeline.io.output import Output
from pipeline.io.tar import TarShardWriter, iter_tar_samples
from pipeline.loader.dataset import resolve_dataset
from pipeline.manifest import read_manifest, verify_dataset
from pipeline.prepare.job import prepare_dataset
from pipeline.prepare.reshard import ReshardSpec, claim_repack, repack_dataset, reshard_dataset, target_shard_count
from pipeline.specs import AugmentSpec, PrepareSpec, ShardSpec


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reshard") / "raw"
    make_demo_dataset(str(root), 30, min_side=96, max_side=200, workers=1)
    return root


def prepared(raw: Path, out: Path, *, variants: int = 0, per_shard: int = 7) -> Path:
    spec = PrepareSpec(
        source=str(raw), out=str(out), shards=ShardSpec(max_samples=per_shard), augment=AugmentSpec(variants=variants)
    )
    prepare_dataset(spec, workers=0)
    return out


def samples_of(root: Path) -> dict[tuple[int | None, str], dict[str, bytes]]:
    manifest = read_manifest(Output(str(root)))
    found: dict[tuple[int | None, str], dict[str, bytes]] = {}
    for shard in manifest.shards:
        for key, members in iter_tar_samples(str(root / shard.path)):
            assert (shard.variant, key) not in found, f"duplicate key {key}"
            found[(shard.variant, key)] = members
    return found


def verified(root: Path) -> object:
    manifest = read_manifest(Output(str(root)))
    result = verify_dataset(Output(str(root)), manifest)
    assert result.ok, result.problems
    return manifest


@pytest.fixture
def forbid_decoding(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to fail the test if anything decodes or opens an image from then on."""
    import PIL.Image

    import pipeline.decode
    import pipeline.prepare.sample.make

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("re-packing decoded an image")

    def forbid() -> None:
        monkeypatch.setattr(PIL.Image, "open", refuse)
        monkeypatch.setattr(pipeline.decode, "decode_image", refuse)
        monkeypatch.setattr(pipeline.prepare.sample.make, "decode_image", refuse)

    return forbid


@pytest.mark.parametrize("variants", [0, 2])
def test_multiple_of_gives_a_divisible_shard_count_with_the_same_samples(
    raw: Path, tmp_path: Path, variants: int, forbid_decoding: Callable[[], None]
) -> None:
    dataset = prepared(raw, tmp_path / "ds", variants=variants)
    forbid_decoding()
    before = samples_of(dataset)
    old = read_manifest(Output(str(dataset)))
    result = reshard_dataset(ReshardSpec(dataset=str(dataset), multiple_of=4))

    manifest = verified(dataset)
    per_set = [s for s in manifest.shards if s.variant == (0 if variants else None)]
    assert len(per_set) % 4 == 0 and len(per_set) == result.shards_after == 8
    assert len(manifest.shards) == 8 * max(1, variants)
    assert samples_of(dataset) == before  # every sample, byte for byte
    assert manifest.samples == old.samples and manifest.classes == old.classes and manifest.params == old.params
    counts = sorted(s.samples for s in per_set)
    assert counts[-1] - counts[0] <= 1  # balanced: every GPU worker gets the same amount
    assert result.version == "r0001" and all(s.path.startswith("r0001/") for s in manifest.shards)


@pytest.mark.parametrize(("variants", "count"), [(0, 7), (2, 4), (0, 1), (0, 30)])
def test_shards_gives_exactly_that_many_balanced_shards(
    raw: Path, tmp_path: Path, variants: int, count: int, forbid_decoding: Callable[[], None]
) -> None:
    dataset = prepared(raw, tmp_path / "ds", variants=variants)  # 30 samples, 5 shards of at most 7 a set
    forbid_decoding()
    before = samples_of(dataset)
    result = reshard_dataset(ReshardSpec(dataset=str(dataset), shards=count))
    manifest = verified(dataset)
    assert result.shards_after == count
    for variant in ([0, 1] if variants else [None]):
        sizes = [s.samples for s in manifest.shards if s.variant == variant]
        assert len(sizes) == count and sum(sizes) == 30
        assert max(sizes) - min(sizes) <= 1
    assert samples_of(dataset) == before
    with pytest.raises(ConfigError, match="cannot cut 30 samples into 31 shards"):
        target_shard_count(manifest, ReshardSpec(dataset=str(dataset), shards=31))


def test_a_repack_delivered_again_finishes_the_same_version_instead_of_claiming_another(raw: Path, tmp_path: Path) -> None:
    dataset = prepared(raw, tmp_path / "ds")
    spec = ReshardSpec(dataset=str(dataset), multiple_of=4, keep=0)
    version = claim_repack(spec)
    (dataset / version / "shard-000000.tar").write_bytes(b"what a run stopped before its swap left")
    first = repack_dataset(spec, version=version)  # writes the claimed folder again
    manifest = (dataset / "manifest.json").read_bytes()
    versions = (dataset / ".gpufeed-versions.json").read_bytes()
    second = repack_dataset(spec, version=version)  # delivered again after its swap: nothing is written
    assert dataclasses.replace(second, seconds=0) == dataclasses.replace(first, seconds=0)
    assert (first.version, first.shards_before, first.shards_after, first.removed) == ("r0001", 5, 8, [""])
    assert (dataset / "manifest.json").read_bytes() == manifest
    assert (dataset / ".gpufeed-versions.json").read_bytes() == versions
    assert sorted(p.name for p in dataset.iterdir() if p.name.startswith("r0")) == ["r0001"]
    verified(dataset)

    out = ReshardSpec(dataset=str(dataset), out=str(tmp_path / "new"), max_samples=10)
    claimed = claim_repack(out)
    first = repack_dataset(out, version=claimed)
    second = repack_dataset(out, version=claimed)  # not refused as "already holds a dataset": it is this one
    assert dataclasses.replace(second, seconds=0) == dataclasses.replace(first, seconds=0)
    with pytest.raises(JobConflictError, match="already holds a dataset"):
        repack_dataset(ReshardSpec(dataset=str(dataset), out=str(tmp_path / "new"), max_samples=5), version="")


def test_shard_count_and_size_bound_the_new_shards(raw: Path, tmp_path: Path) -> None:
    dataset = prepared(raw, tmp_path / "ds")
    reshard_dataset(ReshardSpec(dataset=str(dataset), max_samples=4))
    manifest = verified(dataset)
    assert len(manifest.shards) == 8 and max(s.samples for s in manifest.shards) <= 4

    total = sum(s.bytes for s in manifest.shards)
    reshard_dataset(ReshardSpec(dataset=str(dataset), max_bytes=max(64 * 1024, total // 3)))
    manifest = verified(dataset)
    assert len(manifest.shards) == -(-total // max(64 * 1024, total // 3))

    with pytest.raises(ConfigError, match="at least one sample"):
        target_shard_count(manifest, ReshardSpec(dataset=str(dataset), multiple_of=64))


def test_a_reader_of_the_old_manifest_keeps_working(raw: Path, tmp_path: Path) -> None:
    dataset = prepared(raw, tmp_path / "ds")
    opened = resolve_dataset(str(dataset))  # what a training run holds while a reshard happens
    old_manifest = read_manifest(Output(str(dataset)))
    reshard_dataset(ReshardSpec(dataset=str(dataset), multiple_of=2))

    assert read_manifest(Output(str(dataset))).shards != old_manifest.shards
    assert verify_dataset(Output(str(dataset)), old_manifest).ok  # the old version is intact
    read = sum(1 for ref in opened.sets[0] for _ in iter_tar_samples(ref.url))
    assert read == old_manifest.samples

    # Versions older than `keep` go once two newer ones exist; the previous one stays.
    second = reshard_dataset(ReshardSpec(dataset=str(dataset), max_samples=5))
    assert second.removed == [""]  # the original top-level shards
    assert not any(name.startswith("shard-") for name in os.listdir(dataset))
    assert sorted(n for n in os.listdir(dataset) if re.fullmatch(r"r\d+", n)) == ["r0001", "r0002"]
    third = reshard_dataset(ReshardSpec(dataset=str(dataset), max_samples=6, keep=0))
    assert sorted(third.removed) == ["r0001", "r0002"]
    assert json.loads((dataset / ".gpufeed-versions.json").read_text()) == {"versions": ["r0003"]}
    verified(dataset)


def test_a_failed_reshard_leaves_the_dataset_as_it_was(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = prepared(raw, tmp_path / "ds")
    before = (dataset / "manifest.json").read_bytes()
    real_commit = TarShardWriter.commit
    calls = {"n": 0}

    def flaky_commit(self: TarShardWriter, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk on fire")
        return real_commit(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TarShardWriter, "commit", flaky_commit)
    with pytest.raises(OSError, match="disk on fire"):
        reshard_dataset(ReshardSpec(dataset=str(dataset), multiple_of=4))
    assert (dataset / "manifest.json").read_bytes() == before
    assert not (dataset / "r0001").exists()
    verified(dataset)


def test_a_dataset_changed_meanwhile_is_not_overwritten(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.prepare.reshard as reshard

    dataset = prepared(raw, tmp_path / "ds")
    real_verify = reshard._verify_or_raise

    def verify_then_change(target: Output, manifest: object) -> None:
        real_verify(target, manifest)  # type: ignore[arg-type]
        changed = json.loads((dataset / "manifest.json").read_text())
        changed["created"] = "someone else"
        (dataset / "manifest.json").write_text(json.dumps(changed))

    monkeypatch.setattr(reshard, "_verify_or_raise", verify_then_change)
    with pytest.raises(JobConflictError, match="changed while"):
        reshard_dataset(ReshardSpec(dataset=str(dataset), multiple_of=2))
    assert json.loads((dataset / "manifest.json").read_text())["created"] == "someone else"
    assert not (dataset / "r0001").exists()


def test_out_writes_a_new_dataset_and_leaves_the_old_one(raw: Path, tmp_path: Path, forbid_decoding: Callable[[], None]) -> None:
    dataset = prepared(raw, tmp_path / "ds")
    forbid_decoding()
    before = (dataset / "manifest.json").read_bytes()
    result = reshard_dataset(ReshardSpec(dataset=str(dataset), out=str(tmp_path / "new"), multiple_of=3))
    assert result.version == "" and (dataset / "manifest.json").read_bytes() == before
    manifest = verified(tmp_path / "new")
    assert len(manifest.shards) % 3 == 0 and samples_of(tmp_path / "new") == samples_of(dataset)
    assert (tmp_path / "new" / "rejected.jsonl").exists()
    with pytest.raises(JobConflictError, match="already holds a dataset"):
        reshard_dataset(ReshardSpec(dataset=str(dataset), out=str(tmp_path / "new"), multiple_of=3))


def test_reaugment_writes_fresh_variants_from_the_source(raw: Path, tmp_path: Path) -> None:
    dataset = prepared(raw, tmp_path / "ds", variants=2)
    before = samples_of(dataset)
    result = reshard_dataset(ReshardSpec(dataset=str(dataset), reaugment=True, seed=11, max_samples=10), workers=0)
    manifest = verified(dataset)
    after = samples_of(dataset)
    assert result.reaugmented and manifest.params["seed"] == 11 and manifest.variants == 2
    assert after.keys() == before.keys()
    changed = sum(after[k]["jpg"] != before[k]["jpg"] for k in after)
    assert changed > len(after) // 2  # new random crops, flips and jitter
    assert all(json.loads(after[k]["json"])["seed"] == 11 for k in after)
    assert not (dataset / result.version / "manifest.json").exists()  # only the top-level manifest is a switch


def test_reaugment_keeps_the_current_shard_layout(raw: Path, tmp_path: Path) -> None:
    dataset = prepared(raw, tmp_path / "ds", variants=1)
    reshard_dataset(ReshardSpec(dataset=str(dataset), multiple_of=4))  # 5 -> 8 shards
    result = reshard_dataset(ReshardSpec(dataset=str(dataset), reaugment=True, seed=3), workers=0)
    assert (result.shards_before, result.shards_after) == (8, 8)
    verified(dataset)


def test_publish_reaugment_twice_makes_one_version_with_the_same_result(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish repeated after a crash right after the switch completes that swap, it does not make another."""
    import pipeline.prepare.reshard as reshard
    import pipeline.prepare.versions as versions

    dataset = prepared(raw, tmp_path / "ds", variants=1)
    reshard_dataset(ReshardSpec(dataset=str(dataset), multiple_of=4))  # r0001: 5 -> 8 shards
    spec = ReshardSpec(dataset=str(dataset), reaugment=True, seed=5, max_samples=10)
    staged = reshard.plan_reaugment(spec)
    prepare_dataset(staged, workers=0)

    def die(output: Output, record: dict[str, object]) -> None:
        raise KeyboardInterrupt("the worker died")

    real_complete = versions._complete_swap
    monkeypatch.setattr(versions, "_complete_swap", die)
    with pytest.raises(KeyboardInterrupt):
        reshard.publish_reaugment(spec, staged)
    monkeypatch.setattr(versions, "_complete_swap", real_complete)
    switched = (dataset / "manifest.json").read_bytes()
    assert versions.version_of(read_manifest(Output(str(dataset)))) == "r0002"
    assert (dataset / "v0").is_dir()  # the original shards (a top-level variant set) are still there

    first = reshard.publish_reaugment(spec, staged)
    second = reshard.publish_reaugment(spec, staged)
    assert (dataset / "manifest.json").read_bytes() == switched
    assert sorted(n for n in os.listdir(dataset) if re.fullmatch(r"r\d+", n)) == ["r0001", "r0002"]
    assert json.loads((dataset / ".gpufeed-versions.json").read_text()) == {"versions": ["r0001", "r0002"]}
    assert not (dataset / "v0").exists()  # keep=1: the original went
    assert not (dataset / "r0002" / "manifest.json").exists()
    one, two = first.to_dict(), second.to_dict()
    assert one.pop("seconds") >= 0 and two.pop("seconds") >= 0
    assert one == two
    assert (first.version, first.shards_before, first.shards_after, first.removed) == ("r0002", 8, 3, [""])
    assert (first.samples, first.rejected, first.reaugmented) == (30, 0, True)
    verified(dataset)

    reshard_dataset(ReshardSpec(dataset=str(dataset), multiple_of=2))  # r0003 replaces it
    replaced = (dataset / "manifest.json").read_bytes()
    with pytest.raises(JobConflictError, match="replaced it since"):
        reshard.publish_reaugment(spec, staged)
    assert (dataset / "manifest.json").read_bytes() == replaced


def test_publish_reaugment_to_out_twice_gives_the_same_result(raw: Path, tmp_path: Path) -> None:
    import pipeline.prepare.reshard as reshard

    dataset = prepared(raw, tmp_path / "ds", variants=1)
    spec = ReshardSpec(dataset=str(dataset), out=str(tmp_path / "new"), reaugment=True, seed=5)
    staged = reshard.plan_reaugment(spec)
    prepare_dataset(staged, workers=0)
    first = reshard.publish_reaugment(spec, staged)
    manifest = (tmp_path / "new" / "manifest.json").read_bytes()
    second = reshard.publish_reaugment(spec, staged)
    assert (tmp_path / "new" / "manifest.json").read_bytes() == manifest
    assert dataclasses.replace(first, seconds=0) == dataclasses.replace(second, seconds=0)
    assert (first.version, first.shards_before, first.shards_after, first.samples) == ("", 5, 5, 30)
    verified(tmp_path / "new")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"^give max_samples, shards, max_bytes or multiple_of \(or reaugment with seed=S\)$"),
        ({"seed": 3}, "^seed only applies with reaugment"),
        ({"reaugment": True}, "^reaugment needs seed=S"),
        ({"reaugment": True, "seed": 1, "multiple_of": 4}, "^multiple_of cannot be combined with reaugment"),
        ({"multiple_of": 0}, "^multiple_of must be"),
        ({"max_bytes": 10}, "^max_bytes must be at least 65536"),
        ({"max_samples": 0}, "^max_samples must be at least 1"),
        ({"keep": 101, "multiple_of": 2}, "^keep must be"),
        ({"out": "DS", "multiple_of": 2}, "^out must differ from dataset"),
        ({"shards": 0}, "^shards must be"),
        ({"shards": 2.5}, "^shards must be a whole number"),
        ({"shards": 4, "multiple_of": 2}, "^shards sets the layout on its own; give it without multiple_of$"),
        ({"shards": 4, "max_samples": 2, "max_bytes": 1 << 20}, "give it without max_samples, max_bytes$"),
        ({"shards": 4, "reaugment": True, "seed": 1}, "re-augment first, then reshard with shards=N"),
    ],
)
def test_bad_reshard_specs_are_refused_naming_the_settings(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        ReshardSpec(dataset="DS", **fields)  # type: ignore[arg-type]
    assert "--" not in str(refused.value)  # the fields' names, not the command's options


def test_not_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(ManifestError):
        reshard_dataset(ReshardSpec(dataset=str(tmp_path), multiple_of=2))


def test_the_reshard_command(raw: Path, tmp_path: Path) -> None:
    dataset = prepared(raw, tmp_path / "ds")
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "reshard", str(dataset), "--multiple-of", "4"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "re-packed" in result.stdout and "5 -> 8 shards" in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline", "reshard", str(dataset), "--multiple-of", "1000"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("gpufeed: error: ") and "Traceback" not in bad.stderr


def test_reaugment_from_another_folder_finds_a_source_prepared_relative(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(raw.parent)
    spec = PrepareSpec(
        source=raw.name, out=str(tmp_path / "ds"), shards=ShardSpec(max_samples=7), augment=AugmentSpec(variants=1)
    )
    prepare_dataset(spec, workers=0)
    assert read_manifest(Output(str(tmp_path / "ds"))).source == str(raw)  # what `submit reshard`'s worker checks
    monkeypatch.chdir(tmp_path)
    result = reshard_dataset(ReshardSpec(dataset=str(tmp_path / "ds"), reaugment=True, seed=4), workers=0)
    assert result.reaugmented and result.samples == 30
    verified(tmp_path / "ds")
