"""Secrets a user puts in a job (SRC, OUT, storage options) never reach a job record, a worker's log or `gpufeed status`.

Real Redis, a real `gpufeed worker` process (service_harness), the CLI in subprocesses; the
whole Redis database is dumped and grepped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from service_harness import Service

pytestmark = pytest.mark.slow
pytest_plugins = ["service_fixtures"]  # service, small_raw, slow_raw

SECRETS = ["KEYID1", "PASSWORD1", "SIG2", "CRED2", "TOKEN2", "KEYID3", "PASSWORD3", "TOKEN4", "KEYID5", "PASSWORD5",
           "KEYID6", "PASSWORD6", "PASSWORD7", "SIG8", "PASSWORD9"]  # fmt: skip


def _refused_submissions(raw: Path, out: Path) -> list[list[str]]:
    """One submission per place a user can put a credential (the secrets are the capitalised words)."""
    return [
        ["prepare", "http://KEYID1:PASSWORD1@127.0.0.1:9/raw", str(out)],
        ["prepare", "s3://bucket/raw?X-Amz-Signature=SIG2&X-Amz-Credential=CRED2&X-Amz-Security-Token=TOKEN2", str(out)],
        ["prepare", str(raw), "s3://KEYID3:PASSWORD3@bucket/out"],
        ["prepare", str(raw), "https://127.0.0.1:9/out?token=TOKEN4"],
        ["prepare", str(raw), str(out), "--storage-option", "endpoint_url=http://KEYID5:PASSWORD5@127.0.0.1:9/"],
        ["prepare", str(raw), str(out), "--storage-option", "key=KEYID6", "--storage-option", "secret=PASSWORD6"],
        ["prepare", str(raw), str(out), "--storage-option", 'client_kwargs={"aws_secret_access_key": "PASSWORD7"}'],
        ["reshard", "s3://bucket/dataset?sig=SIG8", "--shard-samples", "4"],
        ["bench-disk", "s3://user:PASSWORD9@bucket/disk"],
    ]


def _dump(client: Any) -> str:
    """Every key of the database and its value, as text (and each value's DUMP bytes, as Redis stores them)."""
    lines = []
    for key in sorted(client.scan_iter(match="*", count=1000)):
        kind = client.type(key)
        value: Any
        if kind == "hash":
            value = client.hgetall(key)
        elif kind == "string":
            value = client.get(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "set":
            value = sorted(client.smembers(key))
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        else:
            value = kind
        raw = client.execute_command("DUMP", key, NEVER_DECODE=True) or b""
        lines.append(f"{key} {kind} {json.dumps(value, default=str)} {raw.decode('latin-1')}")
    return "\n".join(lines)


def test_a_job_with_secrets_anywhere_is_refused_and_nothing_of_them_is_stored_logged_or_shown(
    service: Service, small_raw: Path, tmp_path: Path
) -> None:
    worker = service.start_worker("w1")
    out = tmp_path / "out"
    for args in _refused_submissions(small_raw, out):
        result = service.cli("submit", *args, "--json")
        shown = result.stdout + result.stderr
        assert result.returncode != 0, (args, shown)
        assert "credential" in shown, (args, shown)  # says why, and what to do instead
        assert not [secret for secret in SECRETS if secret in shown], (args, shown)
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "8")  # a clean job runs as ever
    assert service.wait_finished(job).state == "succeeded"

    status = service.cli("status", job, "--json").stdout + service.cli("jobs", "--json").stdout
    dump = _dump(service.store.client)
    assert json.loads(service.cli("status", job, "--json").stdout)["state"] == "succeeded"
    for where, text in (("redis", dump), ("worker log", worker.text()), ("status --json", status)):
        assert not [secret for secret in SECRETS if secret in text], where
    assert job in dump  # the dump is of the job's database
