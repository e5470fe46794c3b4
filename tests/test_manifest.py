"""manifest.json: round trips, clear errors, and verify_dataset catching damage."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import ManifestError
from pipeline.io.output import Output
from pipeline.io.tar import TarShardWriter
from pipeline.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    read_manifest,
    verify_dataset,
    write_manifest,
)
from pipeline.prepare.plan import shard_name


def _manifest(shards: list[ShardInfo], samples: int | None = None, **kwargs) -> Manifest:
    values = {
        "samples": sum(s.samples for s in shards) if samples is None else samples,
        "classes": ["cat", "dog"],
        "shards": shards,
        "params": {"seed": 0, "resize": {"size": 64}},
        "source": "/data/src",
        "rejected": 1,
    }
    values.update(kwargs)
    return Manifest(**values)


def _write_shard(out: Output, index: int, samples: int, variant: int | None = None) -> ShardInfo:
    rel = shard_name(index) if variant is None else f"v{variant}/{shard_name(index)}"
    with TarShardWriter(out.local(rel)) as writer:
        for i in range(samples):
            key = f"s{index}_{i}"
            writer.write_sample(key, {"jpg": os.urandom(300 + i), "cls": b"1", "json": b"{}"})
        return writer.commit(rel, variant)


@pytest.fixture
def dataset(tmp_path):
    """A small valid dataset: three shards of 4, 4 and 2 samples and its manifest."""
    out = Output(str(tmp_path / "out"))
    out.makedirs()
    shards = [_write_shard(out, 0, 4), _write_shard(out, 1, 4), _write_shard(out, 2, 2)]
    manifest = _manifest(shards)
    write_manifest(out, manifest)
    return out, manifest


# ---------------------------------------------------------------------------
# Round trips


def test_write_read_round_trip(dataset):
    out, manifest = dataset
    again = read_manifest(out)
    assert again == manifest
    assert again.created  # filled in on write
    assert again.format == MANIFEST_FORMAT


def test_manifest_file_is_plain_json_with_the_documented_fields(dataset):
    out, manifest = dataset
    with open(out.local(MANIFEST_NAME), encoding="utf-8") as handle:
        data = json.load(handle)
    assert data["format"] == "gpufeed-manifest/1"
    assert {"format", "samples", "classes", "shards", "params", "source", "rejected", "created"} <= set(data)
    assert data["samples"] == 10
    assert data["classes"] == ["cat", "dog"]
    assert data["shards"][0] == {
        "path": "shard-000000.tar",
        "samples": 4,
        "bytes": manifest.shards[0].bytes,
        "sha256": manifest.shards[0].sha256,
    }
    assert not any(name.startswith(".") or ".tmp" in name for name in os.listdir(out.root))


def test_created_is_kept_when_given(tmp_path):
    out = Output(str(tmp_path))
    write_manifest(out, _manifest([], samples=0, created="2024-01-01T00:00:00+00:00"))
    assert read_manifest(out).created == "2024-01-01T00:00:00+00:00"


def test_variant_shards_round_trip(tmp_path):
    out = Output(str(tmp_path))
    shards = [_write_shard(out, 0, 3, variant=0), _write_shard(out, 0, 3, variant=1)]
    manifest = _manifest(shards, samples=3, variants=2)
    write_manifest(out, manifest)
    again = read_manifest(out)
    assert again == manifest
    assert [s.variant for s in again.shards] == [0, 1]
    assert verify_dataset(out, again).ok


def test_non_ascii_text_round_trips(tmp_path):
    out = Output(str(tmp_path))
    manifest = _manifest([], samples=0, classes=["été", "日本"], source="/données")
    write_manifest(out, manifest)
    assert read_manifest(out) == manifest


shard_infos = st.builds(
    ShardInfo,
    path=st.lists(
        st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="/\\"), min_size=1, max_size=8).filter(
            lambda part: part not in (".", "..")
        ),
        min_size=1,
        max_size=3,
    )
    .map("/".join)
    .filter(lambda path: "://" not in path),
    samples=st.integers(0, 10**6),
    bytes=st.integers(512 * 10**6, 2**40),  # room for its samples' headers
    sha256=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    variant=st.none(),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=100, deadline=None)
@given(
    samples=st.integers(0, 10**7),
    classes=st.lists(st.text(max_size=10), max_size=5),
    shards=st.lists(shard_infos, max_size=5, unique_by=lambda shard: shard.path),
    params=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    source=st.text(max_size=30),
    rejected=st.integers(0, 10**6),
    created=st.text(max_size=30),
    variants=st.integers(0, 100),
)
def test_dict_round_trip(samples, classes, shards, params, source, rejected, created, variants):
    if variants:
        shards = [dataclasses.replace(shard, variant=i % variants) for i, shard in enumerate(shards)]
    samples = min(samples, sum(shard.bytes // 512 for shard in shards))
    manifest = Manifest(samples, classes, shards, params, source, rejected, created, variants)
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


# ---------------------------------------------------------------------------
# Clear errors


def test_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match="no manifest.json in .*not a prepared dataset"):
        read_manifest(Output(str(tmp_path)))


def test_not_json(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="cannot read"):
        read_manifest(Output(str(tmp_path)))


def test_not_utf8(tmp_path):
    (tmp_path / MANIFEST_NAME).write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ManifestError):
        read_manifest(Output(str(tmp_path)))


@pytest.mark.parametrize(
    ("data", "found"),
    [
        ({"name": "some other tool", "version": 3}, "None"),
        ({"format": "gpufeed-manifest/2", "samples": 1}, "gpufeed-manifest/2"),
        ({"format": "webdataset"}, "webdataset"),
        ([1, 2, 3], "list"),
        ("gpufeed-manifest/1", "str"),
        (None, "NoneType"),
    ],
)
def test_foreign_or_wrong_format(tmp_path, data, found):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="is not a gpufeed manifest") as caught:
        read_manifest(Output(str(tmp_path)))
    message = str(caught.value)
    assert found in message
    assert MANIFEST_FORMAT in message
    assert str(tmp_path) in message


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d.pop("shards"),
        lambda d: d.pop("samples"),
        lambda d: d.update(samples="many"),
        lambda d: d.update(shards=None),
        lambda d: d.update(shards=[{"path": "x.tar"}]),
        lambda d: d.update(shards=["x.tar"]),
        lambda d: d.update(params="seed=0"),
    ],
)
def test_malformed_manifest(dataset, damage):
    out, manifest = dataset
    data = manifest.to_dict()
    damage(data)
    with open(out.local(MANIFEST_NAME), "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    with pytest.raises(ManifestError, match="malformed"):
        read_manifest(out)


# ---------------------------------------------------------------------------
# verify_dataset


def test_verify_passes_on_a_good_dataset(dataset):
    out, manifest = dataset
    result = verify_dataset(out, read_manifest(out))
    assert result.ok, result.problems
    assert result.problems == []
    assert result.shards_checked == 3
    assert result.samples_checked == 10
    assert result.bytes_checked == sum(s.bytes for s in manifest.shards)


@pytest.mark.parametrize("where", ["header", "data", "end"])
def test_verify_reports_a_flipped_byte(dataset, where):
    out, manifest = dataset
    path = out.local(manifest.shards[1].path)
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    offset = {"header": 10, "data": 512 + 5, "end": len(data) - 1}[where]
    data[offset] ^= 0x01
    with open(path, "wb") as handle:
        handle.write(bytes(data))
    result = verify_dataset(out, manifest)
    assert not result.ok
    assert any(manifest.shards[1].path in p and "sha256" in p for p in result.problems), result.problems
    assert not any(manifest.shards[0].path in p for p in result.problems)


def test_verify_reports_a_missing_shard(dataset):
    out, manifest = dataset
    os.unlink(out.local(manifest.shards[2].path))
    result = verify_dataset(out, manifest)
    assert not result.ok
    assert f"{manifest.shards[2].path}: missing" in result.problems
    assert result.shards_checked == 3


@pytest.mark.parametrize("keep", [0, 100, 1024 + 10, "half", "all_but_one"])
def test_verify_reports_a_truncated_shard(dataset, keep):
    out, manifest = dataset
    shard = manifest.shards[0]
    path = out.local(shard.path)
    size = os.path.getsize(path)
    length = {"half": size // 2, "all_but_one": size - 1}.get(keep, keep)  # type: ignore[arg-type]
    with open(path, "r+b") as handle:
        handle.truncate(length)
    result = verify_dataset(out, manifest)
    assert not result.ok
    problems = [p for p in result.problems if p.startswith(shard.path)]
    assert any(f"{length} bytes, manifest says {shard.bytes}" in p for p in problems), result.problems
    assert any("sha256" in p for p in problems)


def test_verify_reports_an_appended_shard(dataset):
    out, manifest = dataset
    with open(out.local(manifest.shards[0].path), "ab") as handle:
        handle.write(b"\0" * 512)
    result = verify_dataset(out, manifest)
    assert not result.ok


def test_verify_reports_wrong_shard_sample_count(dataset):
    out, manifest = dataset
    wrong = ShardInfo(manifest.shards[0].path, 5, manifest.shards[0].bytes, manifest.shards[0].sha256)
    manifest.shards[0] = wrong
    manifest.samples = 11
    result = verify_dataset(out, manifest)
    assert not result.ok
    assert f"{wrong.path}: 4 samples, manifest says 5" in result.problems
    assert len(result.problems) == 1  # the total (11) agrees with the shards' claims


def test_verify_reports_wrong_total(dataset):
    out, manifest = dataset
    manifest.samples = 12
    result = verify_dataset(out, manifest)
    assert not result.ok
    assert any("shards hold 10 samples, manifest says 12" in p for p in result.problems), result.problems


def test_verify_reports_a_short_variant_set(tmp_path):
    out = Output(str(tmp_path))
    shards = [_write_shard(out, 0, 3, variant=0), _write_shard(out, 0, 2, variant=1)]
    result = verify_dataset(out, _manifest(shards, samples=3, variants=2))
    assert not result.ok
    assert any("variant set v1" in p and "2 samples" in p for p in result.problems), result.problems
    assert not any("v0" in p for p in result.problems)


def test_verify_reports_a_shard_that_is_not_a_tar(dataset):
    out, manifest = dataset
    shard = manifest.shards[2]
    garbage = b"this is not a tar file at all" * 40
    with open(out.local(shard.path), "wb") as handle:
        handle.write(garbage)
    result = verify_dataset(out, manifest)
    assert not result.ok
    problems = [p for p in result.problems if p.startswith(shard.path)]
    assert problems
    assert any("sha256" in p for p in problems)


def test_verify_a_swapped_shard_is_caught(dataset):
    out, manifest = dataset
    a, b = out.local(manifest.shards[0].path), out.local(manifest.shards[1].path)
    os.replace(a, a + ".x")
    os.replace(b, a)
    os.replace(a + ".x", b)
    result = verify_dataset(out, manifest)
    assert not result.ok
    assert {p.split(":")[0] for p in result.problems} == {manifest.shards[0].path, manifest.shards[1].path}


def test_verify_over_a_memory_output(tmp_path):
    import uuid

    local = Output(str(tmp_path))
    shards = [_write_shard(local, 0, 3)]
    remote = Output(f"memory://gpufeed-test-{uuid.uuid4().hex}/ds")
    remote.makedirs()
    os.replace(local.local(shards[0].path), remote.local(shards[0].path))
    remote.publish(shards[0].path)
    manifest = _manifest(shards)
    write_manifest(remote, manifest)
    try:
        assert read_manifest(remote) == manifest
        assert verify_dataset(remote, manifest).ok
    finally:
        remote.remove("")
        shutil.rmtree(remote.staging, ignore_errors=True)


def test_verify_reports_samples_without_shards(tmp_path):
    out = Output(str(tmp_path))
    result = verify_dataset(out, _manifest([], samples=10))
    assert not result.ok


def test_verify_reports_a_missing_variant_set(tmp_path):
    out = Output(str(tmp_path))
    shards = [_write_shard(out, 0, 3, variant=0)]
    result = verify_dataset(out, _manifest(shards, samples=3, variants=2))
    assert not result.ok


def test_verify_reads_the_shards_with_the_streaming_reader_not_tarfile(dataset, monkeypatch):
    import tarfile

    def no_tarfile(*args, **kwargs):
        raise AssertionError("verify_dataset parsed a shard with tarfile")

    monkeypatch.setattr(tarfile, "open", no_tarfile)
    monkeypatch.setattr(tarfile.TarFile, "__init__", no_tarfile)
    out, manifest = dataset
    result = verify_dataset(out, manifest)
    assert result.ok, result.problems
    assert result.samples_checked == 10


def test_verify_names_a_truncated_member_once(dataset):
    out, manifest = dataset
    shard = manifest.shards[0]
    with tarfile.open(out.local(shard.path)) as tar:
        image = next(member for member in tar.getmembers() if member.size > 200)
    with open(out.local(shard.path), "r+b") as handle:
        handle.truncate(image.offset_data + 100)  # a member's header and part of its data
    problems = [p for p in verify_dataset(out, manifest).problems if p.startswith(shard.path)]
    assert f"{shard.path}: unreadable tar: truncated tar member" in problems, problems


def test_verify_counts_samples_by_the_key_rule(tmp_path):
    out = Output(str(tmp_path))
    rel = shard_name(0)
    with TarShardWriter(out.local(rel)) as writer:
        writer.write_sample("dir/a", {"jpg": b"1", "cls": b"0"})
        writer.write_sample("other/a", {"jpg": b"2"})  # the same base name in another folder: another sample
        writer.write_sample("b", {"seg.png": b"3", "jpg": b"4"})
        info = writer.commit(rel)
    assert info.samples == 3
    result = verify_dataset(out, _manifest([info]))
    assert result.ok, result.problems
    assert result.samples_checked == 3


def test_verify_hashes_every_byte_the_reader_did_not_need(dataset, monkeypatch):
    import pipeline.io.tar as tar_module

    monkeypatch.setattr(tar_module, "_CHUNK", 512)  # the reader stops well before the file ends
    out, manifest = dataset
    shard = manifest.shards[1]
    with open(out.local(shard.path), "r+b") as handle:
        handle.seek(-1, os.SEEK_END)  # in the zero padding after the end-of-archive blocks
        handle.write(b"\1")
    result = verify_dataset(out, manifest)
    assert result.problems == [f"{shard.path}: sha256 mismatch (file changed or corrupted)"]


# ---------------------------------------------------------------------------
# A dataset named by a path or URL


@pytest.mark.parametrize("form", ["str", "path", "file_url", "output"])
def test_read_and_verify_take_a_path_a_url_or_an_output(dataset, form):
    import pathlib

    out, manifest = dataset
    where = {
        "str": out.root,
        "path": pathlib.Path(out.root),
        "file_url": f"file://{out.root}",
        "output": out,
    }[form]
    assert read_manifest(where) == manifest
    result = verify_dataset(where)  # reads the manifest itself
    assert result.ok, result.problems
    assert result.shards_checked == 3 and result.samples_checked == 10
    assert verify_dataset(where, manifest).ok


def test_verify_without_a_manifest_checks_against_the_datasets_own(dataset):
    out, manifest = dataset
    os.unlink(out.local(manifest.shards[2].path))
    assert verify_dataset(out.root).problems == [f"{manifest.shards[2].path}: missing"]


def test_verify_of_a_folder_without_a_manifest_says_so(tmp_path):
    with pytest.raises(ManifestError, match="no manifest.json in .*not a prepared dataset"):
        verify_dataset(str(tmp_path))
    with pytest.raises(ManifestError, match="absent does not exist"):
        read_manifest(tmp_path / "absent")


# ---------------------------------------------------------------------------
# A dataset never reaches outside itself


def _with_shard_path(out: Output, manifest: Manifest, index: int, rel: str) -> None:
    data = manifest.to_dict()
    data["shards"][index]["path"] = rel
    (_root(out) / MANIFEST_NAME).write_text(json.dumps(data))


def _root(out: Output):
    from pathlib import Path

    return Path(out.root)


@pytest.mark.parametrize(
    "rel",
    [
        "/etc/passwd",
        "../../etc/passwd",
        "v0/../../outside.tar",
        "./shard-000000.tar",
        "a//b.tar",
        "file:///etc/passwd",
        "s3://another-bucket/shard-000000.tar",
        "shard\\..\\..\\x.tar",
        "shard-000000.tar\x00",
        "",
    ],
)
def test_a_shard_path_that_leaves_the_dataset_is_refused_before_a_byte_is_read(dataset, rel) -> None:
    out, manifest = dataset
    _with_shard_path(out, manifest, 1, rel)
    with pytest.raises(ManifestError, match="names a shard outside the dataset"):
        read_manifest(out)


def test_a_shard_listed_twice_is_refused(dataset) -> None:
    out, manifest = dataset
    _with_shard_path(out, manifest, 2, manifest.shards[0].path)
    with pytest.raises(ManifestError, match="more than once"):
        read_manifest(out)


def test_a_shard_that_links_outside_the_dataset_is_refused_unless_allowed(dataset, tmp_path) -> None:
    from pipeline.loader import make_loader

    out, manifest = dataset
    root = _root(out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shard = root / manifest.shards[1].path
    shutil.move(shard, elsewhere / "kept.tar")
    os.symlink(elsewhere / "kept.tar", shard)
    with pytest.raises(ManifestError, match=r"link to .*kept\.tar, outside the dataset folder"):
        verify_dataset(out)
    with pytest.raises(ManifestError, match="outside the dataset folder"):
        make_loader(str(root), 2, device="cpu", num_workers=0)
    # Opted in: the same link is read, and the dataset verifies.
    assert verify_dataset(out, links_outside=True).ok
    loader = make_loader(str(root), 2, device="cpu", num_workers=0, links_outside=True, crop=8)
    assert loader.dataset.samples == manifest.samples
    # A link that stays inside the dataset is fine without opting in.
    os.unlink(shard)
    shutil.move(elsewhere / "kept.tar", root / "inside.tar")
    os.symlink(root / "inside.tar", shard)
    assert verify_dataset(out).ok


def test_a_dataset_folder_reached_through_a_link_is_inside_itself(dataset, tmp_path) -> None:
    out, _ = dataset
    link = tmp_path / "link-to-out"
    os.symlink(out.root, link)
    assert verify_dataset(Output(str(link))).ok


def test_inspect_refuses_a_shard_outside_the_dataset_with_a_message(dataset) -> None:
    import subprocess
    import sys

    out, manifest = dataset
    _with_shard_path(out, manifest, 0, "/etc/passwd")
    for args in (["inspect", out.root], ["inspect", "--verify", out.root]):
        result = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0
        assert "names a shard outside the dataset: '/etc/passwd' is an absolute path" in result.stderr
        assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------
# Hostile manifests: bounded, every field checked, counts no shard could hold refused


def _write_raw(out: Output, data) -> None:
    with open(out.local(MANIFEST_NAME), "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def test_a_manifest_nested_deeper_than_json_can_parse_is_a_manifest_error(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match="nests too deep"):
        read_manifest(Output(str(tmp_path)))


def test_params_nested_too_deep_are_refused(dataset):
    out, manifest = dataset
    data = manifest.to_dict()
    deep: list = []
    data["params"] = {"x": deep}
    for _ in range(200):
        deep.append([])
        deep = deep[0]
    _write_raw(out, data)
    with pytest.raises(ManifestError, match="nested at most"):
        read_manifest(out)


def test_a_manifest_over_the_size_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import pipeline.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 1000)
    (tmp_path / MANIFEST_NAME).write_text(" " * 1001)
    with pytest.raises(ManifestError, match="1001 bytes, over the bound of 1000"):
        read_manifest(Output(str(tmp_path)))
    with pytest.raises(ManifestError, match="over the bound"):
        manifest_module.parse_manifest(b" " * 1001, str(tmp_path))


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda d: d.update(samples=-1), "samples = -1 is out of range"),
        (lambda d: d.update(samples=True), "samples must be an integer"),
        (lambda d: d.update(samples=1.5), "samples must be an integer"),
        (lambda d: d.update(samples="10"), "samples must be an integer"),
        (lambda d: d.update(rejected=-3), "rejected = -3"),
        (lambda d: d.update(variants=-1), "variants = -1"),
        (lambda d: d.update(decoded_with_warnings=2**70), "decoded_with_warnings"),
        (lambda d: d.update(classes=[1, 2]), "classes must be a list of names"),
        (lambda d: d.update(classes="cat,dog"), "classes must be a list of names"),
        (lambda d: d.update(source=5), "source must be a string"),
        (lambda d: d["shards"][0].update(samples=-4), "samples = -4"),
        (lambda d: d["shards"][0].update(bytes=-1), "bytes = -1"),
        (lambda d: d["shards"][0].update(bytes=2**80), "bytes = 1208925819614629174706176"),
        (lambda d: d["shards"][0].update(sha256="abc"), "sha256 must be 64 lower-case hex digits"),
        (lambda d: d["shards"][0].update(sha256="z" * 64), "sha256 must be 64"),
        (lambda d: d["shards"][0].update(sha256=None), "sha256 must be 64"),
        (lambda d: d["shards"][0].update(variant=0), "variant = 0 is out of range"),
        (lambda d: d["shards"][0].update(path=7), "path must be a string"),
        (lambda d: d.update(shards={"a": 1}), "shards must be a list"),
    ],
)
def test_every_field_is_range_checked(dataset, damage, words):
    out, manifest = dataset
    data = manifest.to_dict()
    damage(data)
    _write_raw(out, data)
    with pytest.raises(ManifestError, match="malformed") as caught:
        read_manifest(out)
    assert words in str(caught.value)


def test_a_variant_beyond_the_variant_sets_is_refused(tmp_path):
    out = Output(str(tmp_path))
    shards = [_write_shard(out, 0, 3, variant=0), _write_shard(out, 0, 3, variant=1)]
    data = _manifest(shards, samples=3, variants=2).to_dict()
    data["shards"][1]["variant"] = 2
    _write_raw(out, data)
    with pytest.raises(ManifestError, match="variant = 2 is out of range"):
        read_manifest(out)
    data["shards"][1].pop("variant")
    _write_raw(out, data)
    with pytest.raises(ManifestError, match="variant must be an integer"):
        read_manifest(out)


def test_counts_no_shard_could_hold_are_refused_when_the_manifest_is_read(dataset):
    out, manifest = dataset
    data = manifest.to_dict()
    data["shards"][0]["samples"] = 10**12  # an 8-sample shard of a few KB
    data["samples"] = 10**12 + 6
    _write_raw(out, data)
    with pytest.raises(ManifestError, match="samples = 1000000000000 is out of range"):
        read_manifest(out)
    data = manifest.to_dict()
    data["samples"] = 10**12  # the shards' counts right, the total not
    _write_raw(out, data)
    with pytest.raises(ManifestError, match="samples = 1000000000000 is out of range"):
        read_manifest(out)


def test_inspect_verify_on_a_lying_manifest_ends_at_once_with_a_message(dataset):
    from click.testing import CliRunner

    from pipeline.cli import main

    out, manifest = dataset
    data = manifest.to_dict()
    data["shards"] = [dict(data["shards"][0], path=f"{i}/{data['shards'][0]['path']}") for i in range(3)]
    data["shards"][2]["samples"] = 10**9
    _write_raw(out, data)
    result = CliRunner().invoke(main, ["inspect", out.root, "--verify"])
    assert result.exit_code != 0 and "out of range" in result.output and "Traceback" not in result.output


def test_verify_reads_no_more_of_a_shard_than_the_manifest_says(dataset, monkeypatch):
    out, manifest = dataset
    shard = manifest.shards[0]
    with open(out.local(shard.path), "r+b") as handle:
        handle.truncate(8 << 30)  # 8 GiB, sparse: a shard that grew, or one whose manifest lies
    taken = []
    real_open = Output.open_read

    def counted(self, rel):
        handle = real_open(self, rel)
        read = handle.read
        handle_readinto = handle.readinto

        class Counted:
            def read(self, size=-1):
                data = read(size)
                taken.append(len(data))
                return data

            def readinto(self, view):
                got = handle_readinto(view)
                taken.append(got or 0)
                return got

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                handle.close()

        return Counted()

    monkeypatch.setattr(Output, "open_read", counted)
    result = verify_dataset(out, manifest)
    assert f"{shard.path}: {8 << 30} bytes, manifest says {shard.bytes}" in result.problems
    assert sum(taken) <= sum(s.bytes for s in manifest.shards) + 3  # one byte past each shard at most


@pytest.mark.parametrize("variant", [["v0"], "1", {"a": 1}, 1.0, True])
def test_a_variant_of_the_wrong_type_is_a_manifest_error_for_verify_and_the_loader(tmp_path, variant):
    # Found by tests/test_fuzz.py: verify_dataset met it as a dict key (TypeError: unhashable type: 'list'),
    # the loader sorted the variant sets with it (TypeError: '<' not supported between 'int' and 'str').
    from pipeline.loader.dataset import resolve_dataset

    out = Output(str(tmp_path))
    shards = [_write_shard(out, 0, 3, variant=0), _write_shard(out, 0, 3, variant=1)]
    data = _manifest(shards, samples=3, variants=2).to_dict()
    data["shards"][1]["variant"] = variant
    _write_raw(out, data)
    with pytest.raises(ManifestError, match="variant must be an integer"):
        verify_dataset(out)
    with pytest.raises(ManifestError, match="variant must be an integer"):
        resolve_dataset(str(tmp_path))
