"""gpufeed's S3 client against a store that misbehaves on purpose (`hostile_s3_server`, on loopback).

Every case ends, in bounded time and a bounded number of requests, as a
StorageError naming what was asked, or as None (the caller reads it
another way): a region answer that never settles, a listing that never
ends, headers or a body sent a byte at a time, lengths that lie, lengths
that are no number, a redirect to another host. The blocking client
(`S3Transport.fetch`), the read-ahead loop (`read_ahead`) and the listing
are each put to it; the memory of reads ahead is measured in a child
process whose address space is capped; and one `gpufeed prepare` runs on
such a store end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")

from hostile_s3_server import REGIONS, HostileStore, hostile  # noqa: E402

from pipeline.errors import ConfigError, StorageError  # noqa: E402
from pipeline.io.s3.config import DEADLINE_ENV, REQUEST_DEADLINE_S, S3Settings, request_deadline  # noqa: E402
from pipeline.io.s3.getloop import GetLoop  # noqa: E402
from pipeline.io.s3.request import MAX_REGION_CHANGES, RETRIES  # noqa: E402
from pipeline.io.s3.transport import S3Transport  # noqa: E402
from pipeline.io.transport import FsspecTransport  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 0.5  # each request's total deadline here
WAIT_S = 10.0  # far past every bound below: a case that reaches it hangs
OBJECT = "bucket/raw/a.jpg"
LIMIT = (512 << 20) + 1  # what prepare asks for a source file: its default input limit, and one byte
CAP = 2 << 30  # the address space of the children that measure memory

pytestmark = pytest.mark.timeout(60)


@contextmanager
def client(store: HostileStore, deadline_s: float = DEADLINE_S) -> Iterator[S3Transport]:
    """The fast transport on `store`'s endpoint, unsigned (nothing behind it: only its own answers count)."""
    transport = S3Transport(S3Settings(store.endpoint, "us-east-1", None, deadline_s=deadline_s), FsspecTransport(None))
    try:
        yield transport
    finally:
        transport.close()


WAYS: dict[str, Callable[[S3Transport], Any]] = {
    "blocking": lambda transport: transport.fetch(OBJECT, LIMIT),
    "read-ahead": lambda transport: transport.read_ahead(OBJECT, LIMIT, in_flight=2).result(WAIT_S),
    "listing": lambda transport: transport.list("bucket/raw/", delimiter="/"),
}


def ends(call: Callable[[], Any], within_s: float) -> Any:
    """What `call()` gives or raises (the exception itself), asserted to come within `within_s`."""
    started = time.monotonic()
    try:
        outcome = call()
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        outcome = exc
    took = time.monotonic() - started
    assert took < within_s, f"{took:.1f} s, past {within_s} s: {outcome!r}"
    return outcome


# -- region answers that never settle -----------------------------------------------------


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize(
    ("mode", "regions", "requests"),
    [
        ("region-same", "region us-east-1, the region it was sent to", 1),
        ("region-alternate", "us-east-1 -> eu-west-1 -> us-west-2 -> eu-west-1", 3),
        ("region-new", " -> ".join(["us-east-1", *REGIONS[: MAX_REGION_CHANGES + 1]]), MAX_REGION_CHANGES + 1),
    ],
)
def test_a_region_answer_that_never_settles_is_a_storage_error_naming_the_object_and_the_regions(
    mode: str, regions: str, requests: int, way: str
) -> None:
    with hostile(mode) as store, client(store) as transport:
        raised = ends(lambda: WAYS[way](transport), 2.0)
        assert isinstance(raised, StorageError), raised
        assert store.requests == requests
    message = str(raised)
    assert ("list s3://bucket/raw/" if way == "listing" else f"read s3://{OBJECT}") in message
    assert regions in message, message


# -- listings that never end ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-repeat", "token-cycle"])
def test_a_listing_whose_continuation_token_comes_again_is_a_storage_error(mode: str) -> None:
    with hostile(mode) as store, client(store) as transport:
        raised = ends(lambda: transport.list("bucket/raw/"), 2.0)
        assert isinstance(raised, StorageError) and "list s3://bucket/raw/" in str(raised), raised
        assert store.requests == (2 if mode == "token-repeat" else 3)


def test_a_listing_of_empty_pages_without_end_is_a_storage_error() -> None:
    from pipeline.io.s3.transport import EMPTY_PAGES_MAX

    with hostile("empty-pages") as store, client(store) as transport:
        raised = ends(lambda: transport.list("bucket/raw/"), 10.0)
        assert isinstance(raised, StorageError) and "pages in a row with nothing" in str(raised), raised
        assert store.requests == EMPTY_PAGES_MAX


# -- a name that never resolves ------------------------------------------------------------


@pytest.mark.parametrize("way", list(WAYS))
def test_a_host_name_whose_lookup_never_answers_ends_at_the_request_deadline(monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """The lookup counts against the deadline: a resolver that hangs ends the request on time, not the caller."""
    from pipeline.io.s3 import http1

    never = threading.Event()

    def hanging(host: str, port: int) -> Any:
        never.wait(WAIT_S)
        raise OSError("no answer")

    monkeypatch.setattr(http1, "resolve", hanging)
    with hostile("honest", declared=100) as store:
        named = store.endpoint.replace("127.0.0.1", "store.invalid")  # a name: looked up, not a literal
        transport = S3Transport(S3Settings(named, "us-east-1", None, deadline_s=DEADLINE_S), FsspecTransport(None))
        try:
            raised = ends(lambda: WAYS[way](transport), DEADLINE_S + 1.5)
        finally:
            never.set()
            transport.close()
        assert store.requests == 0
    assert isinstance(raised, StorageError), raised
    assert f"within {DEADLINE_S:g} s" in str(raised), raised


# -- a byte at a time ----------------------------------------------------------------------


@pytest.mark.parametrize("way", ["blocking", "read-ahead"])
@pytest.mark.parametrize("mode", ["slow-head", "slow-body"])
def test_an_answer_sent_a_byte_at_a_time_ends_at_the_request_deadline(mode: str, way: str) -> None:
    with hostile(mode, drip_s=0.15, declared=64) as store, client(store) as transport:
        raised = ends(lambda: WAYS[way](transport), DEADLINE_S + 1.0)
        assert isinstance(raised, StorageError), raised
        assert f"read s3://{OBJECT}" in str(raised) and f"within {DEADLINE_S:g} s" in str(raised)
        assert store.requests == 1  # the deadline covers the retries too: none is sent past it


def test_the_deadline_is_set_by_the_environment_and_a_wrong_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEADLINE_ENV, raising=False)
    assert request_deadline() == REQUEST_DEADLINE_S
    monkeypatch.setenv(DEADLINE_ENV, "2.5")
    assert S3Settings("http://127.0.0.1:9", "us-east-1", None).deadline_s == 2.5
    for wrong in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv(DEADLINE_ENV, wrong)
        with pytest.raises(ConfigError, match=DEADLINE_ENV):
            S3Settings("http://127.0.0.1:9", "us-east-1", None)


# -- lengths that lie, or are no number ----------------------------------------------------


@pytest.mark.parametrize("way", ["blocking", "read-ahead"])
def test_a_body_shorter_than_its_length_is_neither_taken_nor_allocated_whole(way: str) -> None:
    with hostile("lying-length", declared=512 << 20, sends=4096) as store, client(store) as transport:
        tracemalloc.start()
        try:
            answer = ends(lambda: WAYS[way](transport), 3.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert answer is None  # tried RETRIES more times, then left to the caller's own read
        assert store.requests == RETRIES + 1
        assert peak < 16 << 20, f"{peak >> 20} MiB allocated for 4 KiB that came of 512 MiB declared"


@pytest.mark.parametrize("way", ["blocking", "read-ahead"])
def test_a_body_shorter_than_its_length_on_a_connection_left_open_ends_at_the_deadline(way: str) -> None:
    with hostile("lying-length", declared=1 << 20, sends=4096, hold=True) as store, client(store) as transport:
        raised = ends(lambda: WAYS[way](transport), DEADLINE_S + 1.0)
        assert isinstance(raised, StorageError) and f"read s3://{OBJECT}" in str(raised), raised


@pytest.mark.parametrize("way", ["blocking", "read-ahead"])
@pytest.mark.parametrize(
    ("mode", "length"),
    [("bad-length", "-1"), ("bad-length", "lots"), ("bad-length", "1e9"), ("bad-length", "+64"),
     ("bad-length", "9" * 19), ("bad-length", "9" * 40), ("bad-length", "64, 65"), ("huge-chunk", "")],
)  # fmt: skip
def test_a_length_that_is_no_byte_count_or_past_the_bound_is_refused_at_once(mode: str, length: str, way: str) -> None:
    with hostile(mode, length_text=length) as store, client(store) as transport:
        assert ends(lambda: WAYS[way](transport), 2.0) is None  # not retried: the caller's own read says what it is
        assert store.requests == 1


@pytest.mark.parametrize("way", ["blocking", "read-ahead"])
def test_an_answer_longer_than_the_range_asked_for_is_refused_unread(way: str) -> None:
    with hostile("whole", declared=64 << 20) as store, client(store) as transport:
        ask = {
            "blocking": lambda: transport.fetch(OBJECT, 100),
            "read-ahead": lambda: transport.read_ahead(OBJECT, 100).result(WAIT_S),
        }
        tracemalloc.start()
        try:
            assert ends(ask[way], 2.0) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert store.requests == 1 and peak < 1 << 20


def test_a_redirect_to_another_host_is_never_followed() -> None:
    from pipeline.io.fs import read_source_bytes, storage_options_for

    with hostile("honest", declared=100) as elsewhere, hostile("moved-elsewhere", location=elsewhere.endpoint) as store:
        with client(store) as transport:
            for way in ("blocking", "read-ahead", "listing"):
                raised = ends(lambda: WAYS[way](transport), 2.0)  # noqa: B023 - called at once
                assert isinstance(raised, StorageError), raised
                assert "redirects it to another host (127.0.0.1)" in str(raised), raised
        url = f"s3://{OBJECT}"
        options = {"endpoint_url": store.endpoint, "anon": True, "skip_instance_cache": True}
        with storage_options_for([url], options):  # not handed to s3fs either, whose HTTP client would follow it
            raised = ends(lambda: read_source_bytes(url, 1 << 20), 5.0)
        assert isinstance(raised, StorageError), raised
        assert elsewhere.requests == 0
        assert store.requests == 4


def test_a_cache_fill_from_a_store_that_drips_ends_as_one_source_error_saying_it_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pipeline.errors import SourceError
    from pipeline.io.cache.fill import copy_from_store

    monkeypatch.setenv(DEADLINE_ENV, str(DEADLINE_S))
    with hostile("slow-body", drip_s=0.15, declared=64) as store:
        options = {"endpoint_url": store.endpoint, "anon": True, "skip_instance_cache": True}
        fd = os.open(tmp_path / "partial", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            raised = ends(lambda: copy_from_store(f"s3://{OBJECT}", fd, 64, storage_options=options), DEADLINE_S + 2.0)
        finally:
            os.close(fd)
    assert isinstance(raised, SourceError), raised
    message = str(raised)
    assert message.count("cannot read") == 1 and f"s3://{OBJECT}" in message and f"within {DEADLINE_S:g} s" in message, message


# -- the memory of reads ahead, in a child whose address space is capped ----------------------

CHILD = textwrap.dedent(
    """
    import resource, sys, threading
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    from pipeline.io.s3.getloop import GetLoop
    from pipeline.io.s3.config import S3Settings

    def rss_kb(field):
        with open("/proc/self/status") as status:
            return int(status.read().split(field + ":")[1].split()[0])

    endpoint, reads, budget, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    loop = GetLoop(S3Settings(endpoint, "us-east-1", None, deadline_s=deadline), reads, budget_bytes=budget)
    sizes, lock, all_in = [], threading.Lock(), threading.Event()

    def done(answer):  # the body is let go as soon as it is counted: only what is in flight stays
        size = "error" if answer.exception() else len(answer.result() or b"")
        with lock:
            sizes.append(size)
            if len(sizes) == reads:
                all_in.set()

    base = rss_kb("VmRSS")
    for number in range(reads):
        loop.get(f"bucket/k{{number}}", {limit}).add_done_callback(done)
    assert all_in.wait(30), sizes
    loop.close()
    print("sizes", sorted(set(map(str, sizes))))
    print("grown_mb", (rss_kb("VmHWM") - base) // 1024)
    """
)


def read_ahead_in_a_child(store: HostileStore, reads: int, budget: int, deadline_s: float = 20.0) -> tuple[str, int]:
    """(the sizes read, as a line; the child's peak RSS over its start, MiB) for `reads` reads ahead at once."""
    script = CHILD.format(cap=CAP, limit=LIMIT)
    done = subprocess.run(
        [sys.executable, "-c", script, store.endpoint, str(reads), str(budget), str(deadline_s)],
        capture_output=True, text=True, timeout=40, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sizes, grown = done.stdout.splitlines()[-2:]
    return sizes, int(grown.split()[1])


def test_reads_ahead_of_lying_lengths_hold_only_the_bytes_that_came() -> None:
    with hostile("lying-length", declared=512 << 20, sends=4096) as store:
        sizes, grown_mb = read_ahead_in_a_child(store, reads=14, budget=256 << 20)
    assert sizes == "sizes ['0']"  # each left to the caller's own read, after its retries
    assert grown_mb < 64, f"{grown_mb} MiB for 14 answers of 4 KiB declaring 512 MiB each"


def test_reads_ahead_hold_at_most_their_byte_budget_in_flight() -> None:
    # Each answer declares 32 MiB and sends 17 of them: a body read that far has grown its buffer to 32 MiB, and none
    # ends before the deadline, so every body let in is in memory at once: 2 in the budget, 10 without one.
    body = 32 << 20
    with hostile("lying-length", declared=body, sends=(17 << 20), hold=True) as store:
        sizes, grown_mb = read_ahead_in_a_child(store, reads=10, budget=2 * body, deadline_s=1.5)
    assert sizes == "sizes ['error']"  # each a StorageError at its deadline
    assert grown_mb < 4 * body >> 20, f"{grown_mb} MiB for a budget of {2 * body >> 20} MiB"  # 10 at once: 320 MiB


def test_answers_held_for_the_budget_are_all_read_in_turn() -> None:
    with hostile("honest", declared=3 << 20) as store:
        loop = GetLoop(S3Settings(store.endpoint, "us-east-1", None, deadline_s=WAIT_S), 6, budget_bytes=1 << 20)
        try:
            answers = [loop.get(f"bucket/k{number}", LIMIT) for number in range(6)]  # each over the whole budget
            assert [len(answer.result(WAIT_S) or b"") for answer in answers] == [3 << 20] * 6
        finally:
            loop.close()


# -- end to end ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "keys", "says"),
    [("region-alternate", [], "cannot list s3://bucket/raw/: the store sends it from region to region"),
     ("slow-body", [f"{number}.jpg" for number in range(6)], "cannot read s3://bucket/raw/"),],
    ids=["listing-in-a-region-loop", "reads-ahead-a-byte-at-a-time"],
)  # fmt: skip
def test_prepare_on_a_hostile_store_stops_in_one_line(mode: str, keys: list[str], says: str, tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env[DEADLINE_ENV] = str(DEADLINE_S)
    with hostile(mode, keys=keys, declared=64) as store:
        options = ["--storage-option", f"endpoint_url={store.endpoint}", "--storage-option", "anon=true"]
        command = [sys.executable, "-m", "pipeline", "prepare", "s3://bucket/raw", str(tmp_path / "out"), *options]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
        took = time.monotonic() - started
        requests = store.requests
    output = done.stdout + done.stderr
    assert done.returncode != 0 and output.startswith("gpufeed: error: ") and len(output.splitlines()) == 1, output
    assert says in output, output
    assert took < 20 and requests <= MAX_REGION_CHANGES + 1 + len(keys), (took, requests, output)  # each read once
