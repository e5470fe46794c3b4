"""Service settings, the Celery configuration, path checks and spec validation (no Redis, no workers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, GpufeedError, StorageError
from pipeline.io.fs import redact_url
from pipeline.specs import PrepareSpec
from pipeline.units import parse_duration
from worker import security
from worker.app import celery_config, make_app
from worker.schedules import describe, make_schedule
from worker.settings import ServiceSettings, settings_from_env


def test_defaults_are_safe() -> None:
    settings = settings_from_env({})
    assert settings.broker_url == settings.result_backend == "redis://localhost:6379/0"
    assert settings.allowed_roots == ()
    assert settings.stale_after_s == 60 and settings.heartbeat_interval_s == 10
    assert settings.visibility_timeout_s > settings.hard_time_limit_s > settings.shard_time_limit_s


def test_settings_come_from_the_environment() -> None:
    settings = settings_from_env(
        {
            "GPUFEED_BROKER_URL": "redis://:pw@redis:6379/2",
            "GPUFEED_ALLOWED_ROOTS": "/data:/shards,s3://bucket/prefix",
            "GPUFEED_SHARD_TIME_LIMIT": "10m",
            "GPUFEED_STALE_AFTER": "90s",
            "GPUFEED_JOB_TTL": "2d",
            "GPUFEED_QUEUE": "prep",
            "GPUFEED_MAX_ATTEMPTS": "3",
        }
    )
    assert settings.result_backend == "redis://:pw@redis:6379/2"
    assert settings.allowed_roots == ("/data", "/shards", "s3://bucket/prefix")
    assert settings.shard_time_limit_s == 600 and settings.visibility_timeout_s > 600 + 60
    assert settings.stale_after_s == 90 and settings.job_ttl_s == 2 * 86400
    assert settings.queue == "prep" and settings.max_attempts == 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUFEED_SHARD_TIME_LIMIT": "1h", "GPUFEED_VISIBILITY_TIMEOUT": "30m"}, "VISIBILITY_TIMEOUT"),
        ({"GPUFEED_STALE_AFTER": "5s", "GPUFEED_HEARTBEAT_INTERVAL": "10s"}, "STALE_AFTER"),
        ({"GPUFEED_JOB_TTL": "forever"}, "not a duration"),
        ({"GPUFEED_BROKER_URL": "amqp://guest@rabbit//"}, "redis://"),
        ({"GPUFEED_QUEUE": "a queue; rm -rf"}, "GPUFEED_QUEUE"),
        ({"GPUFEED_MAX_ATTEMPTS": "0"}, "GPUFEED_MAX_ATTEMPTS"),
    ],
)
def test_bad_settings_are_refused_clearly(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings_from_env(env)


def test_durations_and_passwords() -> None:
    assert parse_duration("90") == 90 and parse_duration("10m") == 600 and parse_duration("1.5h") == 5400
    with pytest.raises(ConfigError):
        parse_duration("0s")
    assert redact_url("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("redis://user:secret@host/0") == "redis://***:***@host/0"  # an access key id is a secret too
    assert redact_url("https://TOKEN@host/x") == "https://***@host/x"
    signed = redact_url("https://h/b/k.jpg?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abc&X-Amz-Security-Token=t&versionId=3")
    assert signed == "https://h/b/k.jpg?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***&versionId=3"
    assert redact_url("https://h/c?sig=abc&sp=r") == "https://h/c?sig=***&sp=r"
    assert redact_url("redis://:p@ss@Redis-1:6379/0?ssl=1") == "redis://:***@Redis-1:6379/0?ssl=1"  # '@' in a password
    assert redact_url("redis://localhost:6379/0") == "redis://localhost:6379/0"
    assert redact_url("redis://[::1") == "<unparseable URL>"


def test_one_default_broker_and_one_way_to_hide_its_password() -> None:
    from pipeline.measure import doctor

    assert ServiceSettings().broker_url == settings_from_env({}).broker_url == doctor.DEFAULT_BROKER_URL
    with pytest.raises(ConfigError) as refused:
        settings_from_env({doctor.BROKER_URL_ENV: "amqp://guest:hunter2@rabbit//"})
    assert "hunter2" not in str(refused.value) and "***:***@rabbit" in str(refused.value)


def test_storage_errors_are_retryable_and_others_are_not() -> None:
    assert StorageError("disk full").retryable is True
    assert not any(error("x").retryable for error in (GpufeedError, ConfigError))
    settings = settings_from_env({"GPUFEED_RETRY_DELAY": "2s"})
    assert settings.retry_delay_s == 2 and settings_from_env({}).retry_delay_s == 10
    with pytest.raises(ConfigError, match="GPUFEED_RETRY_DELAY"):
        settings_from_env({"GPUFEED_RETRY_DELAY": "soon"})


def test_celery_runs_json_only_with_late_acks_and_bounded_tasks() -> None:
    settings = settings_from_env({"GPUFEED_SHARD_TIME_LIMIT": "20m"})
    conf = celery_config(settings)
    assert conf["task_serializer"] == conf["result_serializer"] == conf["event_serializer"] == "json"
    assert conf["accept_content"] == ["json"] and conf["result_accept_content"] == ["json"]
    assert conf["task_acks_late"] is True and conf["task_reject_on_worker_lost"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["task_soft_time_limit"] == 1200 and conf["task_time_limit"] > conf["task_soft_time_limit"]
    assert conf["broker_transport_options"]["visibility_timeout"] > conf["task_time_limit"]
    assert conf["beat_scheduler"] == "redbeat.RedBeatScheduler" and conf["redbeat_redis_url"] == settings.broker_url

    app = make_app(settings)
    assert app.conf.accept_content == ["json"] and app.conf.task_acks_late is True
    app.loader.import_default_modules()
    names = {"gpufeed.plan_prepare", "gpufeed.write_prepare_shard", "gpufeed.finalize_prepare", "gpufeed.repack_dataset",
             "gpufeed.benchmark_disk", "gpufeed.cleanup_job", "gpufeed.run_schedule"}
    assert names <= set(app.tasks)


def test_paths_must_lie_under_the_allowed_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "data").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    (root / "inner").symlink_to(root / "data")
    roots = [str(root), "s3://bucket/datasets"]

    assert security.check_path(str(root / "data" / "x"), roots, "OUT") == str(root / "data" / "x")
    assert security.check_path(str(root / "inner" / "new"), roots, "OUT")  # a link that stays inside
    assert security.check_path("s3://bucket/datasets/imagenet", roots, "SRC")
    assert security.check_path(f"file://{root}/data", roots, "SRC")
    refused = {
        str(outside / "x"): "outside",
        str(root / "link" / "x"): "outside",  # symlinks are followed
        f"{root}/data/../../outside": "'..'",
        "relative/path": "relative",
        "s3://bucket/other": "outside",
        "s3://bucket/datasets-evil": "outside",  # a prefix of the name is not a folder
        f"{root}x/data": "outside",
        "": "non-empty",
        "/tmp/a\nb": "control characters",
    }
    for path, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            security.check_path(path, roots, "OUT")
    with pytest.raises(ConfigError, match="GPUFEED_ALLOWED_ROOTS is not set"):
        security.check_path(str(root / "data"), [], "OUT")


def test_relative_paths_are_made_absolute_before_submission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert security.absolute("data/raw") == str(tmp_path / "data" / "raw")
    assert security.absolute("s3://bucket/x") == "s3://bucket/x"
    with pytest.raises(ConfigError, match="'..'"):
        security.absolute("data/../../etc", "SRC")


def test_job_specs_are_validated(tmp_path: Path) -> None:
    settings = ServiceSettings(allowed_roots=(str(tmp_path),))
    spec = PrepareSpec(source=str(tmp_path / "raw"), out=str(tmp_path / "out")).to_dict()
    payload = security.validate_job("prepare", {"spec": spec}, settings)
    assert payload == {"spec": spec, "force": False, "overwrite": False}
    assert security.job_paths("prepare", payload) == [str(tmp_path / "out")]

    bad = [
        ("prepare", {"spec": {**spec, "resize": {"size": 3}}}, "size must be between 8 and 16384"),
        ("prepare", {"spec": {**spec, "colour": "blue"}}, "unknown setting"),
        ("prepare", {"spec": spec, "rm": True}, "unknown field"),
        ("prepare", {"spec": spec, "force": "yes"}, "true or false"),
        ("prepare", "not a dict", "JSON object"),
        ("prepare", {"spec": {**spec, "out": "x" * 70000}}, "the job spec is"),
        # A job spec is JSON: its errors name the spec's own fields.
        ("reshard", {"spec": {"dataset": str(tmp_path / "ds")}}, "give max_samples, shards, max_bytes or multiple_of"),
        ("reshard", {"spec": {"dataset": str(tmp_path / "ds"), "multiple_of": 0}}, "multiple_of must be"),
        ("bench-disk", {"path": str(tmp_path), "options": {"file_bytes": 1 << 50}}, "file_bytes"),
        ("bench-disk", {"path": str(tmp_path), "options": {"shell": "rm -rf /"}}, "unknown option"),
        ("mine-bitcoin", {}, "unknown job kind"),
        ("prepare", {"spec": {**spec, "max_pixels": 10**12}}, "GPUFEED_MAX_PIXELS"),
        ("prepare", {"spec": {**spec, "max_file_bytes": 1 << 40}}, "GPUFEED_MAX_FILE_BYTES"),
    ]
    for kind, job, message in bad:
        with pytest.raises(ConfigError, match=message):
            security.validate_job(kind, job, settings)


def test_outputs_are_locked_by_their_real_path(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert security.lock_name(str(tmp_path / "alias") + "/") == os.path.realpath(tmp_path / "real")
    assert security.lock_name("s3://bucket/x/") == "s3://bucket/x"


def test_schedules_parse_intervals_and_crontabs() -> None:
    assert describe(make_schedule("6h", None)) == "every 6h"
    assert describe(make_schedule("90", None)) == "every 90s"
    assert describe(make_schedule(None, "0 */6 * * 1-5")) == "cron 0 */6 * * 1-5 (UTC)"
    for every, cron, message in [
        (None, None, "exactly one"),
        ("1h", "0 * * * *", "exactly one"),
        (None, "0 * *", "five fields"),
        (None, "61 * * * *", "not a valid crontab"),
        ("sometimes", None, "not a duration"),
    ]:
        with pytest.raises(ConfigError, match=message):
            make_schedule(every, cron)


def test_a_source_folder_may_not_link_outside_the_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "src" / "cats").mkdir(parents=True)
    outside.mkdir()
    (root / "src" / "cats" / "a.jpg").write_bytes(b"x")
    (outside / "secret.jpg").write_bytes(b"x")
    (root / "src" / "cats" / "inside.jpg").symlink_to(root / "src" / "cats" / "a.jpg")
    # a folder is walked at once, and leaves nothing to check per listed file
    assert security.listed_source_check(str(root / "src"), [str(root)]) is None  # links that stay inside are fine

    (root / "src" / "cats" / "b.jpg").symlink_to(outside / "secret.jpg")
    with pytest.raises(ConfigError, match="a link to .* outside GPUFEED_ALLOWED_ROOTS"):
        security.listed_source_check(str(root / "src"), [str(root)])
    (root / "src" / "cats" / "b.jpg").unlink()
    (root / "src" / "dogs").symlink_to(outside)
    with pytest.raises(ConfigError, match="outside GPUFEED_ALLOWED_ROOTS"):
        security.listed_source_check(str(root / "src"), [str(root)])
    (root / "src" / "dogs").unlink()
    (root / "src" / "loop").symlink_to(root / "src")  # a loop back inside: checked once, no endless walk
    assert security.listed_source_check(str(root / "src"), [str(root)]) is None


def test_a_list_file_or_a_url_source_is_checked_file_by_file_as_the_plan_lists_it(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    listing = root / "list.jsonl"
    check = security.listed_source_check(str(listing), [str(root)])
    assert check is not None
    check(str(root / "src" / "a.jpg"))
    with pytest.raises(ConfigError, match="lists .*secret.jpg.*outside GPUFEED_ALLOWED_ROOTS"):
        check(str(outside / "secret.jpg"))
    bucket = security.listed_source_check("s3://bench/raw", ["s3://bench/"])
    assert bucket is not None
    bucket("s3://bench/raw/cats/a.jpg")
    for escape in ("s3://other/raw/a.jpg", "s3://bench/raw/../secret/a.jpg"):
        with pytest.raises(ConfigError, match="outside GPUFEED_ALLOWED_ROOTS"):
            bucket(escape)
    with pytest.raises(ConfigError, match="lists a file the service may not read.*query string") as signed:
        bucket("s3://bench/raw/cats/a.jpg?X-Amz-Signature=SIGNED")
    assert "SIGNED" not in str(signed.value) and "X-Amz-Signature=***" in str(signed.value)


def test_status_shows_the_samples_decoded_with_warnings_only_when_there_are_some(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from worker.cli import _print_status
    from worker.jobs import JobRecord

    def shown(result: dict[str, object], redispatched: int = 0) -> tuple[dict[str, object], str]:
        record = JobRecord(
            "j1", "prepare", "succeeded", {"spec": {"source": "/raw"}}, "gpufeed", 1.0, samples=9, result=result,
            redispatched=redispatched,
        )  # fmt: skip
        _print_status(record.to_status(), as_json=True)
        doc = json.loads(capsys.readouterr().out)
        _print_status(record.to_status(), as_json=False)
        return doc, capsys.readouterr().out

    doc, text = shown({"manifest": "/out/manifest.json", "samples": 9, "decoded_with_warnings": 3})
    assert doc["decoded_with_warnings"] == 3
    assert "samples 9, rejected 0, decoded with warnings 3" in text
    doc, text = shown({"manifest": "/out/manifest.json", "samples": 9, "decoded_with_warnings": 0})
    assert doc["decoded_with_warnings"] == 0 and "warnings" not in text


@pytest.mark.parametrize(("tasks", "said"), [(1, "1 task"), (3, "3 tasks")])
def test_status_says_how_many_tasks_were_sent_again_in_words(tasks: int, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import _print_status
    from worker.jobs import JobRecord

    record = JobRecord("j1", "prepare", "running", {"spec": {}}, "gpufeed", 1.0, redispatched=tasks)
    _print_status(record.to_status(), as_json=False)
    assert capsys.readouterr().out.splitlines()[-1] == f"  re-dispatched after a worker was lost: {said}"
