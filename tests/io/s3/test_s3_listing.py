"""Listing a source on S3 with signed ListObjectsV2 requests parsed here: the same listing s3fs gives, at a fraction of the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("s3fs")

from pipeline.io.fs import open_fs, storage_options_for  # noqa: E402
from pipeline.io.s3.transport import S3Transport, parse_listing  # noqa: E402
from pipeline.io.transport import FsspecTransport  # noqa: E402
from pipeline.io.transports import transport_for  # noqa: E402
from pipeline.prepare import sources  # noqa: E402
from pipeline.prepare.sources import ListingInfo, list_images  # noqa: E402

if TYPE_CHECKING:
    from s3_fixtures import S3Server

pytest_plugins = ["s3_fixtures"]

NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'

# A class folder with what real buckets hold: nested folders, hidden files and folders, files that are
# no images, names S3 must URL-encode in a listing, a folder marker, a file and a folder of one name.
TRICKY = [
    "cats/a.jpg",
    "cats/B.png",
    "cats/notes.txt",
    "cats/.DS_Store",
    "cats/.thumbs/t.jpg",
    "cats/with space+plus%percent.jpg",
    "cats/ünïcödé ñame.JPEG",
    "cats/deep/er/z.webp",
    "cats/deep/y.jpg",
    "cats/deep/er/",
    "cats/empty/",
    "cats/x.jpg/inside.jpg",
    "cats/x.jpg",
    "dogs/c.jpg",
    "dogs/sub/d.jpg",
    ".hidden-class/e.jpg",
    "beside.jpg",
    "readme.md",
]


def _listing(url: str, options: dict[str, Any], threads: int = 4) -> tuple[list[tuple[str, str, str | None, str]], ListingInfo]:
    info = ListingInfo()
    with storage_options_for([url], options):
        items = [(item.url, item.rel, item.label, item.rejected) for item in list_images(url, info, threads=threads)]
    return items, info


def _by_s3fs(monkeypatch: pytest.MonkeyPatch, url: str, options: dict[str, Any], threads: int = 4) -> Any:
    with monkeypatch.context() as patched:
        patched.setattr(sources, "transport_for", lambda fs: FsspecTransport(fs))
        return _listing(url, options, threads)


def _fill(s3_server: S3Server, bucket: str, prefix: str, keys: list[str]) -> None:
    fs = s3_server.filesystem()
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for key in keys:
        fs.pipe_file(f"{bucket}/{prefix}/{key}", b"" if key.endswith("/") else b"x")


def _counting_lists(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many listings the fast path gave (a list the test reads afterwards)."""
    given = [0]
    real = S3Transport.list

    def counted(self: S3Transport, path: str, delimiter: str | None = None) -> Any:
        listed = real(self, path, delimiter)
        given[0] += listed is not None
        return listed

    monkeypatch.setattr(S3Transport, "list", counted)
    return given


@pytest.mark.parametrize("page_keys", [1000, 2])
@pytest.mark.parametrize("threads", [1, 4])
def test_the_fast_listing_is_the_listing_s3fs_gives(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, page_keys: int, threads: int
) -> None:
    bucket = f"tricky-{page_keys}-{threads}"
    _fill(s3_server, bucket, "raw", TRICKY)
    url = f"s3://{bucket}/raw"
    options = s3_server.storage_options
    expected, expected_info = _by_s3fs(monkeypatch, url, options, threads)
    monkeypatch.setattr("pipeline.io.s3.transport.LIST_PAGE_KEYS", page_keys)  # 2: every folder takes several pages
    fast_lists = _counting_lists(monkeypatch)
    items, info = _listing(url, options, threads)
    assert fast_lists[0] == 3  # the top, then cats and dogs each in one recursive listing
    assert items == expected
    assert info == expected_info
    rels = [rel for _, rel, _, _ in items]
    assert "cats/with space+plus%percent.jpg" in rels and "cats/ünïcödé ñame.JPEG" in rels
    assert "cats/x.jpg" in rels and "cats/x.jpg/inside.jpg" in rels
    assert not any("/." in f"/{rel}" for rel in rels)  # hidden files and folders are not listed
    assert info.classes == ["cats", "dogs"] and info.ignored == 2  # notes.txt; readme.md beside the classes
    assert items[0][1] == "beside.jpg" and items[0][3]  # an image beside the class folders: listed, rejected


def test_a_flat_folder_and_a_bucket_root_are_listed_fast_as_s3fs_lists_them(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(s3_server, "flat-folder", "raw", ["b.jpg", "a.jpg", "sub/c.jpg", "skip.txt"])
    _fill(s3_server, "bucket-root", "top", ["a.jpg"])
    for url in ("s3://flat-folder/raw", "s3://bucket-root"):
        expected = _by_s3fs(monkeypatch, url, s3_server.storage_options)
        with monkeypatch.context() as patched:
            fast_lists = _counting_lists(patched)
            assert _listing(url, s3_server.storage_options) == expected
            assert fast_lists[0] >= 1
    items, info = expected
    assert [(rel, label) for _, rel, label, _ in items] == [("top/a.jpg", "top")] and info.kind == "imagefolder"


def test_names_the_fast_listing_cannot_place_are_listed_by_s3fs(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(s3_server, "odd-names", "raw", ["cats/a.jpg", "cats//b.jpg", "dogs/c.jpg"])
    url = "s3://odd-names/raw"
    expected = _by_s3fs(monkeypatch, url, s3_server.storage_options)
    assert _listing(url, s3_server.storage_options) == expected


def test_a_missing_source_and_a_list_file_still_go_through_s3fs(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.errors import SourceError

    _fill(s3_server, "list-file", "raw", ["cats/a.jpg", "cats/b.jpg"])
    s3_server.filesystem().pipe_file("list-file/raw/list.csv", b"path,label\ncats/b.jpg,x\n")
    fast_lists = _counting_lists(monkeypatch)
    items, info = _listing("s3://list-file/raw/list.csv", s3_server.storage_options)
    assert [(rel, label) for _, rel, label, _ in items] == [("cats/b.jpg", "x")] and info.kind == "list"
    assert fast_lists[0] == 0  # a list file is no folder: no LIST request for it
    with pytest.raises(SourceError, match="source not found"):
        _listing("s3://list-file/nothing-here", s3_server.storage_options)


def test_a_bucket_the_store_does_not_have_gives_no_listing(s3_server: S3Server) -> None:
    _fill(s3_server, "present", "raw", ["a.jpg"])
    getter = transport_for(open_fs("s3://present/raw", s3_server.storage_options)[0])
    assert isinstance(getter, S3Transport)
    assert getter.list("present/raw/") == (["present/raw/a.jpg"], [])
    assert getter.list("no-such-bucket/raw/") is None  # 404: s3fs lists, and says so


def test_parse_listing_decodes_url_encoded_names_and_follows_pages() -> None:
    body = f"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult {NS}><Name>b</Name><Prefix>raw%2F</Prefix><EncodingType>url</EncodingType>
<IsTruncated>true</IsTruncated><NextContinuationToken>tok/en=</NextContinuationToken>
<Contents><Key>raw/a+b%2Bc%25.jpg</Key><Size>1</Size></Contents>
<Contents><Key>raw/%C3%BC.jpg</Key><Size>1</Size></Contents>
<CommonPrefixes><Prefix>raw/sub+dir/</Prefix></CommonPrefixes></ListBucketResult>""".encode()
    assert parse_listing(body) == (["raw/a b+c%.jpg", "raw/ü.jpg"], ["raw/sub dir/"], "tok/en=")
    plain = b"<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>raw/a+b.jpg</Key></Contents></ListBucketResult>"
    assert parse_listing(plain) == (["raw/a+b.jpg"], [], None)  # not URL-encoded: names as they are


@pytest.mark.parametrize(
    "body",
    [
        b"<Error><Code>AccessDenied</Code></Error>",
        b"<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
        b"<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>",
        b"not xml",
    ],
)
def test_parse_listing_refuses_what_is_not_a_whole_listing(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_listing(body)
