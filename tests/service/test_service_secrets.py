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
           "KEYID6", "PASSWORD6", "PASSWORD7", "SIG8", "PASSWORD9", "AZUREKEY10", "BEARER11", "BASIC12", "KEYID13",
           "KEYID14", "GITHUB15", "PEM16", "JWT17", "SASSIG18", "SLACK19", "SRCKEY20", "LISTKEY21"]  # fmt: skip


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
        # every other credential shape, by its name at any depth or by its format under any name: each field is named
        _with_options(
            raw,
            out,
            "connection_string=DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=AZUREKEY10==;",
            "headers=" + json.dumps({"Authorization": "Bearer BEARER11abcdefghijklmnop"}),
            "client_kwargs=" + json.dumps({"headers": {"X-Custom": "Basic BASIC12"}}),
            "profile=AKIAKEYID13XXXXXXXXX",  # an access key id alone, under a harmless name
            "aws_access_key_id=ASIAKEYID14XXXXXXXXX",
        ),
        _with_options(
            raw,
            out,
            "config_kwargs=" + json.dumps({"user_agent_extra": "ghp_GITHUB15aaaaaaaaaaaaaaaaaaaaaaaaaaaa", "note": "xoxb-SLACK19-0123456789"}),
            "client_kwargs=" + json.dumps({"x": [{"y": "-----BEGIN PRIVATE KEY-----\nPEM16\n-----END PRIVATE KEY-----"}]}),
            "headers=" + json.dumps({"X-Trace": "eyJhbGciOiJIUzI1NiJ9.eyJKWT17c3ViIjoiMSJ9.c2lnbmF0dXJlMTc"}),
            "endpoint_url=http://127.0.0.1:9/",  # not a secret, beside them
            "s3_additional_kwargs=" + json.dumps({"extra": "sv=2022-11-02&ss=b&sig=SASSIG18"}),
        ),
        ["prepare", str(raw / "AKIASRCKEY20XXXXXXXX"), str(out)],  # in the spec itself
    ]


# The fields each of the last three submissions names (in order), never their values.
NAMED_FIELDS = [
    ["storage_options.connection_string", "storage_options.headers.Authorization", "storage_options.client_kwargs.headers.X-Custom",
     "storage_options.profile", "storage_options.aws_access_key_id"],
    ["storage_options.config_kwargs.user_agent_extra", "storage_options.config_kwargs.note", "storage_options.client_kwargs.x[0].y",
     "storage_options.headers.X-Trace", "storage_options.s3_additional_kwargs.extra"],
    ["spec.source"],
]  # fmt: skip


def _with_options(raw: Path, out: Path, *settings: str) -> list[str]:
    return ["prepare", str(raw), str(out), *(part for setting in settings for part in ("--storage-option", setting))]


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
    submissions = _refused_submissions(small_raw, out)
    for number, args in enumerate(submissions):
        result = service.cli("submit", *args, "--json")
        shown = result.stdout + result.stderr
        assert result.returncode != 0, (args, shown)
        assert "credential" in shown, (args, shown)  # says why, and what to do instead
        assert not [secret for secret in SECRETS if secret in shown], (args, shown)
        named = NAMED_FIELDS[number - len(submissions)] if number >= len(submissions) - len(NAMED_FIELDS) else []
        assert [field for field in named if field not in shown] == [], shown
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "8")  # a clean job runs as ever
    assert service.wait_finished(job).state == "succeeded"
    # What a worker writes of its own (an error naming a listed path) is redacted on its way to Redis.
    listed = tmp_path / "list.csv"
    listed.write_text("path,label\n/outside/AKIALISTKEY21XXXXXXX/a.png,a\n")
    failed = service.submit("prepare", str(listed), str(tmp_path / "out2"))
    record = service.wait_finished(failed)
    assert record.state == "failed" and "outside GPUFEED_ALLOWED_ROOTS" in record.error, record.error

    status = service.cli("status", job, "--json").stdout + service.cli("status", failed, "--json").stdout
    status += service.cli("jobs", "--json").stdout
    dump = _dump(service.store.client)
    assert json.loads(service.cli("status", job, "--json").stdout)["state"] == "succeeded"
    for where, text in (("redis", dump), ("worker log", worker.text()), ("status --json", status)):
        assert not [secret for secret in SECRETS if secret in text], where
    assert job in dump  # the dump is of the job's database


@pytest.mark.timeout(10)
def test_store_settings_that_are_not_credentials_pass_and_the_refusal_names_the_field_only() -> None:
    from pipeline.errors import ConfigError
    from worker.security import check_storage_options

    plain = {
        "endpoint_url": "http://127.0.0.1:9000", "anon": False, "profile": "team", "region_name": "eu-west-1",
        "client_kwargs": {"region_name": "eu-west-1", "verify": False},
        "config_kwargs": {"signature_version": "s3v4", "s3": {"addressing_style": "path"}, "retries": {"max_attempts": 3}},
        "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/team"},
        "requester_pays": True, "use_ssl": True, "default_block_size": 1 << 20,
        "user_agent_extra": "a-" * 30000 + "A" * 4000,  # long runs: each scan stays linear in the text
    }  # fmt: skip
    assert check_storage_options(plain) == plain
    hostile = {"client_kwargs": {"headers": {"authorization": "SECRET22"}}, "sas_token": "SECRET23"}
    with pytest.raises(ConfigError) as refused:
        check_storage_options(hostile)
    message = str(refused.value)
    assert "storage_options.client_kwargs.headers.authorization" in message and "storage_options.sas_token" in message
    assert "SECRET2" not in message
    nested: dict[str, Any] = {}
    for _ in range(200):  # deeper than any store setting: refused, not walked to the end
        nested = {"a": nested}
    with pytest.raises(ConfigError, match="nested deeper"):
        check_storage_options({"client_kwargs": nested})
