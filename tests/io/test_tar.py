"""The one tar reader and writer: the key rule, crash-safe reproducible shards, a reader that agrees with tarfile."""

from __future__ import annotations

import errno
import hashlib
import io
import itertools
import json
import os
import pickle
import re
import tarfile
import tempfile

import pytest
from hostile_data import END_OF_ARCHIVE, base256, padded, pax_header, tar_file, tar_header
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pipeline.io.tar as tar_module
import pipeline.io.tar_write as tar_write_module
from pipeline.errors import ConfigError, GpufeedError, StorageError
from pipeline.io.fs import file_sha256
from pipeline.io.tar import (
    TAR_MTIME,
    DigestReader,
    ShardInfo,
    TarFormatError,
    TarShardWriter,
    iter_tar_index,
    iter_tar_members,
    iter_tar_samples,
    member_name,
    sample_tar_bytes,
    split_key,
)
from pipeline.prepare.plan import shard_name

# ---------------------------------------------------------------------------
# The key rule: one split for the reader and the writer


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a.jpg", ("a", "jpg")),
        ("a.seg.png", ("a", "seg.png")),
        ("dir/b.jpg", ("dir/b", "jpg")),
        ("a.b/c.d/e.JPG", ("a.b/c.d/e", "jpg")),  # dots in folders belong to the key
        ("sub/dir/key-1f.Seg.PNG", ("sub/dir/key-1f", "seg.png")),
        ("/abs.jpg", ("/abs", "jpg")),
        ("noext", ("noext", "")),
        ("dir/noext", ("dir/noext", "")),
        ("dir.x/noext", ("dir.x/noext", "")),
        ("k.", ("k", "")),
        ("dir/.hidden", ("dir/", "hidden")),
        ("été/日本.jpg", ("été/日本", "jpg")),
    ],
)
def test_split_key(name, expected):
    assert split_key(name) == expected


# webdataset's own rule (tariterators.base_plus_ext, suffixes lower-cased as its grouping does).
# Its regex is line-based, so names with newlines are left out of the comparison.
_name_text = st.text(alphabet=st.sampled_from("./aBé-") | st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=15)


@settings(max_examples=300, deadline=None)
@given(st.builds(lambda head, tail: f"{head}.{tail}", _name_text, _name_text) | _name_text)
def test_split_key_is_webdatasets_rule(name):
    tariterators = pytest.importorskip("webdataset.tariterators")
    prefix, suffix = tariterators.base_plus_ext(name)
    assume(prefix is not None)  # webdataset skips such members (no dot, or a top-level ".name")
    assert split_key(name) == (prefix, suffix.lower())


@pytest.mark.parametrize(("key", "extension"), [("k", "jpg"), ("dir/k", "seg.png"), ("a/b/c-12", "cls"), ("k", "")])
def test_member_name_round_trips_through_the_split(key, extension):
    name = member_name(key, extension)
    assert name == f"{key}.{extension}"
    assert split_key(name) == (key, extension)


@pytest.mark.parametrize(
    ("key", "extension"),
    [
        ("a.b", "jpg"),  # a dot in the key: the reader would give key "a", extension "b.jpg"
        ("dir.x/k", "jpg"),  # no dots anywhere in a key, folders included
        ("", "jpg"),  # ".jpg": webdataset skips it
        ("dir/", "jpg"),  # no base name
        ("k", "JPG"),  # read back as "jpg"
        ("k", "a/b"),  # read back as key "k.a/b"
    ],
)
def test_member_name_refuses_a_key_that_would_split_differently(key, extension):
    with pytest.raises(ValueError, match="cannot store sample"):
        member_name(key, extension)
    with pytest.raises(ValueError, match="cannot store sample"):
        sample_tar_bytes(key, {extension: b"x"})


def test_writer_refuses_a_dotted_key_and_leaves_no_file(tmp_path):
    path = str(tmp_path / shard_name(0))
    with pytest.raises(ValueError, match="cannot store sample"):
        with TarShardWriter(path) as writer:
            writer.write_sample("img.1", {"jpg": b"x"})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# TarShardWriter


def _members(i: int) -> dict[str, bytes]:
    return {"jpg": bytes([i]) * (100 + 37 * i), "cls": str(i % 2).encode(), "json": json.dumps({"i": i}).encode()}


# Keys as prepare makes them (a slug of the source path and a hash of it).
KEYS = [
    "class0_img_0_jpg-337cad9c8038193f",
    "class1_img_1_jpg-6c20eaaf3dc6c49f",
    "class0_img_2_jpg-bfa48f2f4eb12333",
    "class1_img_3_jpg-e90045218cdb99ae",
    "class0_img_4_jpg-b345d2a16e4ce1b0",
]
SAMPLES = [(key, _members(i)) for i, key in enumerate(KEYS)]


def _write(path: str, samples=SAMPLES, variant=None) -> ShardInfo:
    with TarShardWriter(path) as writer:
        for key, members in samples:
            writer.write_sample(key, members)
        return writer.commit(os.path.basename(path), variant)


def test_commit_gives_a_readable_tar(tmp_path):
    path = str(tmp_path / "sub" / shard_name(0))
    info = _write(path)
    assert os.path.exists(path)
    assert os.listdir(tmp_path / "sub") == [shard_name(0)]  # no temp file left
    with tarfile.open(path) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"{k}.{ext}" for k, m in SAMPLES for ext in sorted(m)]
        for member in members:
            assert member.isfile()
            assert member.mtime == TAR_MTIME
            assert member.uid == member.gid == 0
            assert member.uname == member.gname == ""
            assert member.mode == 0o644
        first = tar.extractfile(members[0])
        assert first is not None
    assert list(iter_tar_samples(path)) == SAMPLES
    assert info.samples == len(SAMPLES)


def test_commit_gives_a_webdataset_readable_tar(tmp_path):
    import webdataset as wds

    path = str(tmp_path / shard_name(0))
    _write(path)
    rows = list(wds.WebDataset([path], shardshuffle=False))
    assert [row["__key__"] for row in rows] == [key for key, _ in SAMPLES]
    for row, (_, members) in zip(rows, SAMPLES):
        assert row["jpg"] == members["jpg"]
        assert row["cls"] == members["cls"]
        assert json.loads(row["json"]) == json.loads(members["json"])


def test_webdataset_decodes_keys_and_classes(tmp_path):
    import webdataset as wds

    path = str(tmp_path / shard_name(0))
    _write(path)
    rows = list(wds.WebDataset([path], shardshuffle=False).decode().to_tuple("__key__", "cls", "json"))
    assert [(k, c, j["i"]) for k, c, j in rows] == [(k, i % 2, i) for i, (k, _) in enumerate(SAMPLES)]


def test_two_writes_are_byte_identical(tmp_path):
    a, b = str(tmp_path / "a" / shard_name(0)), str(tmp_path / "b" / shard_name(0))
    info_a = _write(a)
    info_b = _write(b)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    assert info_a.sha256 == info_b.sha256


def test_member_order_is_independent_of_dict_order(tmp_path):
    a, b = str(tmp_path / "a.tar"), str(tmp_path / "b.tar")
    members = {"jpg": b"x", "cls": b"1", "json": b"{}"}
    _write(a, [("k", members)])
    _write(b, [("k", dict(reversed(list(members.items()))))])
    assert file_sha256(a) == file_sha256(b)


def test_shard_info_matches_the_file(tmp_path):
    path = str(tmp_path / shard_name(3))
    info = _write(path, variant=2)
    with open(path, "rb") as handle:
        data = handle.read()
    assert info.bytes == len(data) == os.path.getsize(path)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert (info.sha256, info.bytes) == file_sha256(path)
    assert len(data) % tarfile.RECORDSIZE == 0
    assert info.path == shard_name(3)
    assert info.variant == 2
    assert info.to_dict() == {"path": shard_name(3), "samples": 5, "bytes": len(data), "sha256": info.sha256,
                              "variant": 2}
    assert "variant" not in _write(str(tmp_path / "x.tar")).to_dict()


def test_empty_shard_is_a_valid_tar(tmp_path):
    path = str(tmp_path / "empty.tar")
    info = _write(path, samples=[])
    assert info.samples == 0
    with tarfile.open(path) as tar:
        assert tar.getmembers() == []


def test_exception_leaves_no_temp_and_no_final_file(tmp_path):
    path = str(tmp_path / shard_name(0))
    with pytest.raises(RuntimeError, match="cancelled"):
        with TarShardWriter(path) as writer:
            writer.write_sample(*SAMPLES[0])
            assert os.path.exists(writer.temp_path)
            raise RuntimeError("cancelled")
    assert os.listdir(tmp_path) == []


def test_leaving_without_commit_leaves_nothing(tmp_path):
    path = str(tmp_path / shard_name(0))
    with TarShardWriter(path) as writer:
        writer.write_sample(*SAMPLES[0])
    assert os.listdir(tmp_path) == []


def test_temp_file_is_hidden_in_the_same_folder(tmp_path):
    path = str(tmp_path / shard_name(0))
    writer = TarShardWriter(path)
    assert os.path.dirname(writer.temp_path) == str(tmp_path)
    assert os.path.basename(writer.temp_path).startswith(".")
    assert not os.path.basename(writer.temp_path).endswith(".tar")  # never mistaken for a shard


def test_commit_replaces_a_stale_shard(tmp_path):
    path = tmp_path / shard_name(0)
    path.write_bytes(b"partial garbage")
    info = _write(str(path))
    assert info.bytes == path.stat().st_size
    assert list(iter_tar_samples(str(path))) == SAMPLES


class _FullDisk:
    """A file object whose writes fail like a full disk after `budget` bytes."""

    def __init__(self, raw, budget: int) -> None:
        self.raw = raw
        self.budget = budget

    def write(self, data: bytes) -> int:
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(data)
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _patch_open_full_disk(monkeypatch, budget: int) -> None:
    """Make the shard writer's temp file fail like a full disk after `budget` bytes."""
    import builtins

    def opener(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(handle, budget) if "w" in mode else handle

    monkeypatch.setattr(tar_write_module, "open", opener, raising=False)


@pytest.mark.parametrize("budget", [0, 1500, 4000])
def test_enospc_while_writing_is_storage_error(tmp_path, monkeypatch, budget):
    path = str(tmp_path / shard_name(0))
    _patch_open_full_disk(monkeypatch, budget)
    with pytest.raises(StorageError, match="no space left") as caught:
        with TarShardWriter(path) as writer:
            for key, members in SAMPLES:
                writer.write_sample(key, members)
            writer.commit(shard_name(0))
    cause = caught.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert path in str(caught.value)
    assert "run the same command again" in str(caught.value)
    assert os.listdir(tmp_path) == []


def test_enospc_in_the_end_of_archive_is_storage_error(tmp_path, monkeypatch):
    path = str(tmp_path / shard_name(0))
    sample_bytes = 3 * (512 + 512)  # one small sample: three members, each a header and a data block
    _patch_open_full_disk(monkeypatch, sample_bytes + 100)
    with pytest.raises(StorageError, match="no space left"):
        with TarShardWriter(path) as writer:
            writer.write_sample("k", {"jpg": b"x" * 10, "cls": b"1", "json": b"{}"})
            assert writer.samples == 1  # the sample fitted; the end-of-archive blocks do not
            writer.commit(shard_name(0))
    assert os.listdir(tmp_path) == []


def test_enospc_at_commit_is_storage_error(tmp_path, monkeypatch):
    path = str(tmp_path / shard_name(0))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageError, match="no space left"):
        with TarShardWriter(path) as writer:
            writer.write_sample(*SAMPLES[0])
            monkeypatch.setattr(os, "fsync", no_space)
            writer.commit(shard_name(0))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_other_os_errors_are_storage_errors(tmp_path, monkeypatch):
    path = str(tmp_path / shard_name(0))

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(StorageError, match="cannot write.*Permission denied"):
        with TarShardWriter(path) as writer:
            writer.write_sample(*SAMPLES[0])
            monkeypatch.setattr(os, "replace", denied)
            writer.commit(shard_name(0))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_cannot_create_temp_is_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError, match="cannot create"):
        with TarShardWriter(str(blocker / shard_name(0))):
            pass


def test_iter_tar_samples_groups_members_by_key(tmp_path):
    path = str(tmp_path / "x.tar")
    with tarfile.open(path, "w") as tar:
        for name, data in [("a.jpg", b"1"), ("a.cls", b"0"), ("dir/b.jpg", b"2"), ("b.seg.png", b"3")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    # WebDataset's rule: the key is the member's path up to the first dot of its base name.
    assert list(iter_tar_samples(path)) == [
        ("a", {"jpg": b"1", "cls": b"0"}),
        ("dir/b", {"jpg": b"2"}),
        ("b", {"seg.png": b"3"}),
    ]


# ---------------------------------------------------------------------------
# The streaming reader: what tarfile reads, or a clear error


def _tar_bytes(members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("chunk", [512, 1536, 1 << 22])
def test_reader_reads_what_tarfile_reads(monkeypatch, fmt, chunk):
    monkeypatch.setattr(tar_module, "_CHUNK", chunk)  # members and headers across every chunk boundary
    long_name = "deep/" * 30 + "long.jpg" if fmt != tarfile.USTAR_FORMAT else "deep/long.jpg"
    members = [("a.jpg", os.urandom(1000)), ("a.cls", b"3"), (long_name, os.urandom(5000)), ("e.json", b"")]
    members += [(f"k{i}.jpg", os.urandom(i * 37)) for i in range(20)]
    read = list(iter_tar_members(io.BytesIO(_tar_bytes(members, fmt))))
    assert read == members


def test_reader_refuses_a_damaged_header_and_a_truncated_member():
    data = bytearray(_tar_bytes([("a.jpg", b"x" * 3000), ("b.jpg", b"y" * 100)]))
    damaged = bytes(data[:100]) + bytes([data[100] ^ 0x20]) + bytes(data[101:])  # a flipped bit in the mode field
    with pytest.raises(TarFormatError, match="checksum"):
        list(iter_tar_members(io.BytesIO(damaged)))
    with pytest.raises(TarFormatError, match="truncated"):
        list(iter_tar_members(io.BytesIO(bytes(data[:2048]))))


def test_a_file_cut_at_a_header_ends_there_even_in_a_reused_buffer():
    members = [(f"k{i}.jpg", os.urandom(700 + i)) for i in range(6)]
    data = _tar_bytes(members, tarfile.USTAR_FORMAT)
    assert list(iter_tar_members(io.BytesIO(data))) == members  # its buffer, given back, holds these bytes
    cut = 3 * (512 + 1024)  # each member: a header and two blocks of data
    read = []
    with pytest.raises(TarFormatError, match="truncated tar archive"):  # no end-of-archive blocks: cut short
        read.extend(iter_tar_members(io.BytesIO(data[:cut])))
    assert read == members[:3]  # not an earlier read's headers


@pytest.mark.parametrize("stop_after", [0, 2, None])
def test_digest_reader_hashes_every_byte_however_much_the_reader_took(stop_after):
    data = _tar_bytes([(f"k{i}.jpg", os.urandom(300_000 + i)) for i in range(8)]) + b"after the end"
    reader = DigestReader(io.BytesIO(data))
    members = iter_tar_members(reader)
    assert len(list(itertools.islice(members, stop_after))) == (8 if stop_after is None else stop_after)
    members.close()
    reader.drain()
    assert (reader.hexdigest(), reader.bytes) == (hashlib.sha256(data).hexdigest(), len(data))


def test_reader_refuses_a_header_whose_numbers_are_not_numbers():
    garbage = b"this is not a tar file at all" * 40
    with pytest.raises(TarFormatError, match="corrupt tar header"):
        list(iter_tar_members(io.BytesIO(garbage)))


def test_tar_format_error_names_the_shard_and_pickles():
    error = TarFormatError("s3://bucket/shard-000001.tar", "truncated tar member")
    assert str(error) == "s3://bucket/shard-000001.tar: truncated tar member"
    assert str(TarFormatError("", "truncated tar member")) == "truncated tar member"
    again = pickle.loads(pickle.dumps(error))  # it crosses process boundaries in the loader's workers
    assert (again.url, again.reason, str(again)) == (error.url, error.reason, str(error))
    with pytest.raises(TarFormatError, match=re.escape("x.tar: truncated")):
        list(iter_tar_samples(io.BytesIO(_tar_bytes([("a.jpg", b"x" * 3000)])[:1024]), "x.tar"))


def test_reader_reads_through_read_when_there_is_no_readinto():
    class ReadOnly:
        def __init__(self, data: bytes) -> None:
            self.raw = io.BytesIO(data)

        def read(self, size: int = -1) -> bytes:
            return self.raw.read(size)

    members = [("a.jpg", os.urandom(3000)), ("a.cls", b"1"), ("b.jpg", os.urandom(2 << 20))]
    assert list(iter_tar_members(ReadOnly(_tar_bytes(members)))) == members


# ---------------------------------------------------------------------------
# Property: for any members, the reader gives what tarfile gives, grouped by the key rule


def _tarfile_samples(data: bytes) -> list[tuple[str, dict[str, bytes]]]:
    """The reference: tarfile's regular members, consecutive ones with the same key grouped."""
    samples: list[tuple[str, dict[str, bytes]]] = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for info in tar:
            if not info.isfile():
                continue
            handle = tar.extractfile(info)
            assert handle is not None
            key, extension = split_key(info.name)
            if samples and samples[-1][0] == key:
                samples[-1][1][extension] = handle.read()
            else:
                samples.append((key, {extension: handle.read()}))
    return samples


_contents = st.binary(max_size=3000) | st.integers(0, 70_000).map(lambda n: bytes([n % 251]) * n)
_key_part = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0./"), min_size=1, max_size=12)
_keys = st.lists(_key_part, min_size=1, max_size=3).map("/".join)
_extensions = st.from_regex(r"[a-z0-9]{1,5}(\.[a-z0-9_]{1,4})?", fullmatch=True)
_samples = st.lists(
    st.tuples(_keys, st.dictionaries(_extensions, _contents, min_size=1, max_size=3)),
    max_size=12,
    unique_by=lambda sample: sample[0],
)


@settings(max_examples=80, deadline=None)
@given(samples=_samples, chunk=st.sampled_from([512, 4096, 1 << 20]))
def test_reader_gives_what_tarfile_gives_for_shards_the_writer_wrote(samples, chunk):
    assume(all(len(member_name(key, ext).encode()) <= 100 for key, members in samples for ext in members))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "shard.tar")
        with TarShardWriter(path) as writer:
            for key, members in samples:
                writer.write_sample(key, members)
            info = writer.commit("shard.tar")
        with open(path, "rb") as handle:
            data = handle.read()
    saved = tar_module._CHUNK
    tar_module._CHUNK = chunk  # samples across every buffer boundary
    try:
        read = list(iter_tar_samples(io.BytesIO(data)))
    finally:
        tar_module._CHUNK = saved
    assert read == _tarfile_samples(data) == samples
    assert info.samples == len(samples)


_names = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1, max_size=40)
_long_names = st.lists(_names, min_size=1, max_size=8).map("/".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    members=st.lists(st.tuples(_names | _long_names, _contents), max_size=12),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]),
)
def test_reader_gives_what_tarfile_gives_for_any_tar(members, fmt):
    try:
        data = _tar_bytes(members, fmt)
    except ValueError:  # ustar cannot hold this name (over 100 bytes with no split into 155 + 100)
        assume(False)
    assert list(iter_tar_samples(io.BytesIO(data))) == _tarfile_samples(data)


# ---------------------------------------------------------------------------
# Hostile tars: every malformed input is a TarFormatError, never another exception or a wrong answer


def _read(data: bytes, **options) -> list[tuple[str, bytes]]:
    return list(iter_tar_members(io.BytesIO(data), "x.tar", **options))


@pytest.mark.parametrize("size", [-1, -(2**60), 2**80, 2**88 - 1])
def test_a_base256_size_out_of_range_is_a_tar_format_error(size):
    data = tar_header("a.jpg", size_field=base256(size)) + bytes(4096) + END_OF_ARCHIVE
    with pytest.raises(TarFormatError, match="negative size|over the bound") as caught:
        _read(data)
    assert caught.value.url == "x.tar"


def test_a_base256_size_in_range_is_read():
    data = tar_header("a.jpg", size_field=base256(5)) + padded(b"hello") + END_OF_ARCHIVE
    assert _read(data) == [("a.jpg", b"hello")]


@pytest.mark.parametrize("off", [65521, -65521, 1, 256])
def test_a_checksum_off_by_any_amount_is_refused(off):
    data = tar_header("a.jpg", 5, checksum_off=off) + padded(b"hello") + END_OF_ARCHIVE
    with pytest.raises(TarFormatError, match="checksum"):
        _read(data)


def test_a_signed_checksum_is_accepted_as_tar_does():
    header = bytearray(tar_header("é.jpg", 5))  # bytes over 127 in the name: signed and unsigned sums differ
    header[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in header)
    header[148:156] = b"%06o\0 " % signed
    assert _read(bytes(header) + padded(b"hello") + END_OF_ARCHIVE) == [("é.jpg", b"hello")]


@pytest.mark.parametrize("field", [b"+0000000005\0", b"0_000_000_5\0", b"00000000-5\0 ", b"0000000009\0\0", b"00 0005\0    "])
def test_a_size_field_that_is_not_plain_octal_is_refused(field):
    data = tar_header("a.jpg", size_field=field) + padded(b"hello") + END_OF_ARCHIVE
    with pytest.raises(TarFormatError, match="not a number"):
        _read(data)


def test_a_mode_field_that_is_not_a_number_is_refused():
    header = bytearray(tar_header("a.jpg", 5))
    header[100:108] = b"rwxr-xr-"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    with pytest.raises(TarFormatError, match="not a number"):
        _read(bytes(header) + padded(b"hello") + END_OF_ARCHIVE)


def test_a_pax_size_is_honoured():
    body = os.urandom(3000)
    data = pax_header({"size": str(len(body))}) + tar_header("a.jpg", 0) + padded(body) + tar_file("b.jpg", b"b")
    assert _read(data + END_OF_ARCHIVE) == [("a.jpg", body), ("b.jpg", b"b")]
    tarfile_read = [(m.name, m.size) for m in tarfile.open(fileobj=io.BytesIO(data + END_OF_ARCHIVE))]
    assert tarfile_read == [("a.jpg", 3000), ("b.jpg", 1)]  # what tarfile reads too


def test_a_pax_path_is_honoured_for_the_next_member_only():
    data = pax_header({"path": "long/" * 40 + "x.jpg"}) + tar_file("short.jpg", b"1") + tar_file("b.jpg", b"2")
    assert _read(data + END_OF_ARCHIVE) == [("long/" * 40 + "x.jpg", b"1"), ("b.jpg", b"2")]


def test_a_global_pax_header_applies_to_every_following_member_until_overridden():
    data = (
        tar_file("first.jpg", b"0")
        + pax_header({"path": "global.jpg"}, kind=b"g")
        + tar_file("a.jpg", b"1")
        + tar_file("b.jpg", b"2")
        + pax_header({"path": "own.jpg"})  # a member's own record wins over the global one, for that member
        + tar_file("c.jpg", b"3")
        + tar_file("d.jpg", b"4")
        + pax_header({"path": ""}, kind=b"g")  # an empty value deletes the global record
        + tar_file("e.jpg", b"5")
    )
    names = [name for name, _ in _read(data + END_OF_ARCHIVE)]
    assert names == ["first.jpg", "global.jpg", "global.jpg", "own.jpg", "global.jpg", "e.jpg"]


def test_a_global_pax_size_applies_to_every_following_member():
    data = pax_header({"size": "3"}, kind=b"g") + tar_header("a.jpg", 0) + padded(b"abc") + tar_header("b.jpg", 0) + padded(b"def")
    assert _read(data + END_OF_ARCHIVE) == [("a.jpg", b"abc"), ("b.jpg", b"def")]


@pytest.mark.parametrize(
    "body",
    [b"99 path=a.jpg\n", b"x path=a.jpg\n", b"12 patha.jpg\n", b"13 path=a.jpg!", b"-5 path=a\n", b"0 \n", b"garbage"],
)
def test_a_malformed_pax_record_is_refused(body):
    data = tar_header("././@PaxHeader", len(body), kind=b"x") + padded(body) + tar_file("a.jpg", b"1")
    with pytest.raises(TarFormatError, match="PAX"):
        _read(data + END_OF_ARCHIVE)


@pytest.mark.parametrize("value", ["-3", "abc", "1e9", "٣", "9" * 30])
def test_a_pax_size_that_is_not_a_small_number_is_refused(value):
    data = pax_header({"size": value}) + tar_file("a.jpg", b"1")
    with pytest.raises(TarFormatError, match="PAX|over the bound"):
        _read(data + END_OF_ARCHIVE)


def test_an_empty_file_is_not_an_empty_tar(tmp_path):
    with pytest.raises(TarFormatError, match="empty file"):
        _read(b"")
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(TarFormatError, match="empty.tar: empty file"):
        list(iter_tar_samples(str(tmp_path / "empty.tar")))


@pytest.mark.parametrize("keep", [100, 512 + 512, 2 * (512 + 512) + 300])
def test_a_truncated_archive_is_reported(keep):
    data = tar_file("a.jpg", os.urandom(500)) + tar_file("b.jpg", os.urandom(500)) + END_OF_ARCHIVE
    with pytest.raises(TarFormatError, match="truncated"):
        _read(data[:keep])


def test_one_zero_block_ends_an_archive_as_tar_accepts():
    assert _read(tar_file("a.jpg", b"1") + bytes(512)) == [("a.jpg", b"1")]


def test_a_member_over_the_bound_is_refused_before_it_is_read(monkeypatch):
    class Unreadable(io.BytesIO):  # nothing past the header may be read for a member over the bound
        def readinto(self, view):
            if self.tell() >= 512:
                raise AssertionError("read past the header of a member over the bound")
            return super().readinto(memoryview(view)[:512])

    huge = tar_header("big.jpg", size=3 << 29)  # 1.5 GiB
    with pytest.raises(TarFormatError, match=r"'big.jpg' holds 1610612736 bytes, over the bound of 268435456"):
        list(iter_tar_members(Unreadable(huge)))
    data = tar_file("a.jpg", os.urandom(5000)) + END_OF_ARCHIVE
    with pytest.raises(TarFormatError, match="over the bound of 4096 bytes"):
        _read(data, max_member=4096)
    assert _read(data, max_member=5000) == [("a.jpg", data[512:5512])]
    monkeypatch.setenv(tar_module.MAX_MEMBER_ENV, "4096")
    with pytest.raises(TarFormatError, match=tar_module.MAX_MEMBER_ENV):
        _read(data)


@pytest.mark.parametrize("value", ["0", "-1", "lots", "1.5"])
def test_a_bad_member_bound_setting_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv(tar_module.MAX_MEMBER_ENV, value)
    with pytest.raises(ConfigError, match=tar_module.MAX_MEMBER_ENV):
        _read(tar_file("a.jpg", b"1") + END_OF_ARCHIVE)


def test_a_long_name_or_pax_header_over_its_bound_is_refused():
    data = tar_header("././@LongLink", tar_module.MAX_META_BYTES + 1, kind=b"L") + bytes(4096)
    with pytest.raises(TarFormatError, match="long-name header holds"):
        _read(data)


def test_a_sample_of_many_members_is_bounded_like_one_member():
    data = b"".join(tar_file(f"a.{i}", bytes(1000)) for i in range(10)) + END_OF_ARCHIVE
    with pytest.raises(TarFormatError, match="sample 'a' holds over 4096 bytes"):
        list(iter_tar_samples(io.BytesIO(data), max_member=4096))
    assert len(list(iter_tar_samples(io.BytesIO(data), max_member=10_000))[0][1]) == 10


def test_a_folder_with_a_lying_size_is_read_past_without_holding_it():
    data = tar_header("dir/", 3000, kind=b"5") + padded(bytes(3000)) + tar_file("a.jpg", b"1") + END_OF_ARCHIVE
    assert _read(data) == [("a.jpg", b"1")]
    with pytest.raises(TarFormatError, match="over the bound"):
        _read(data, max_member=1000)


def test_a_tar_format_error_is_a_gpufeed_error():
    assert issubclass(TarFormatError, GpufeedError) and issubclass(TarFormatError, ValueError)


# ---------------------------------------------------------------------------
# The index: names, offsets and sizes from the headers, the data skipped


def _tarfile_bytes(members: list[tuple[str, bytes]], fmt: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_index_gives_each_members_data_offset_and_size(fmt):
    long = "d/" + "x" * 150 if fmt != tarfile.USTAR_FORMAT else "d/short"
    members = [("a.jpg", b"\xff" * 1000), ("a.txt", b"caption"), (f"{long}.jpg", b"J" * 513), ("empty.txt", b"")]
    blob = _tarfile_bytes(members, fmt)
    asked = []

    def read(name, size):
        asked.append((name, size))
        return name.endswith(".txt")

    index = list(iter_tar_index(io.BytesIO(blob), "t.tar", read=read))
    assert [(name, size) for name, _, size, _ in index] == [(name, len(data)) for name, data in members]
    assert asked == [(name, len(data)) for name, data in members]
    for (name, offset, size, data), (_, expected) in zip(index, members):
        assert blob[offset : offset + size] == expected
        assert data == (expected if name.endswith(".txt") else None)


def test_index_skips_folders_and_links():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        folder = tarfile.TarInfo("dir")
        folder.type = tarfile.DIRTYPE
        archive.addfile(folder)
        link = tarfile.TarInfo("dir/link.jpg")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        archive.addfile(link)
        info = tarfile.TarInfo("dir/k.jpg")
        info.size = 3
        archive.addfile(info, io.BytesIO(b"abc"))
    assert [(name, size) for name, _, size, _ in iter_tar_index(io.BytesIO(buffer.getvalue()))] == [("dir/k.jpg", 3)]


@pytest.mark.parametrize(
    "blob, reason",
    [
        (b"", "empty file"),
        (b"\x01" * 512 + END_OF_ARCHIVE, "corrupt tar header"),
        (tar_file("a.jpg", b"x" * 2000)[:1024], "truncated"),
        (tar_file("a.jpg", b"x" * 10), "truncated"),  # no end-of-archive blocks
    ],
)
def test_index_refuses_what_is_not_a_whole_tar(blob, reason):
    with pytest.raises(TarFormatError, match=reason):
        list(iter_tar_index(io.BytesIO(blob), "t.tar"))


def test_index_reads_a_cut_member_it_was_asked_for_as_truncated():
    blob = tar_file("a.txt", b"x" * 2000)[:1024]
    with pytest.raises(TarFormatError, match="truncated"):
        list(iter_tar_index(io.BytesIO(blob), "t.tar", read=lambda name, size: True))
