"""The service's commands as a user runs them: `submit --wait` interrupted, no worker listening, job-id prefixes.

Real Redis, real `gpufeed worker` processes (service_harness), the CLI in subprocesses.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from service_harness import SLOW_FLAGS, Service

from worker.cli import NO_WORKER_AFTER_S

pytestmark = pytest.mark.slow
pytest_plugins = ["service_fixtures"]  # service, small_raw, slow_raw


def start_waiting(service: Service, *args: str) -> subprocess.Popen[str]:
    """`gpufeed submit … --wait` in the background, as a user starts it in a terminal."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "submit", *args, "--wait"],
        env=service.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def job_of(service: Service, out: Path, timeout: float = 30) -> str:
    """The id of the job that writes `out`, once it is recorded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in service.store.list_jobs():
            if record.out == str(out):
                return str(record.id)
        time.sleep(0.1)
    raise AssertionError(f"no job writes {out}")


def interrupt(process: subprocess.Popen[str]) -> tuple[str, str]:
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_interrupted_wait_says_the_job_goes_on_and_how_to_follow_or_cancel_it(
    service: Service, small_raw: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    waiting = start_waiting(service, "prepare", str(small_raw), str(out))
    job = job_of(service, out)
    time.sleep(0.5)
    stdout, stderr = interrupt(waiting)
    assert waiting.returncode == 130, stderr
    assert stdout == "" and "Traceback" not in stderr
    assert stderr.splitlines()[-1] == (
        f"gpufeed: error: stopped waiting; job {job} continues on the service: follow it with gpufeed status {job}, "
        f"stop it with gpufeed cancel {job}"
    )
    assert "complete shards are kept" not in stderr  # that is for a local prepare
    assert service.record(job).state == "queued"  # the job is untouched

    worker = service.start_worker("w1")
    assert service.wait_finished(job, timeout=60).state == "succeeded"
    worker.stop()


def test_interrupted_wait_leaves_a_running_job_running(service: Service, slow_raw: Path, tmp_path: Path) -> None:
    service.start_worker("w1")
    out = tmp_path / "out"
    waiting = start_waiting(service, "prepare", str(slow_raw), str(out), *SLOW_FLAGS)
    job = job_of(service, out)
    service.wait_until(job, lambda r: r.state == "running", 60, "running")
    _, stderr = interrupt(waiting)
    assert waiting.returncode == 130 and f"stopped waiting; job {job} continues" in stderr, stderr
    assert "no worker is listening" not in stderr
    assert service.wait_finished(job, timeout=120).state == "succeeded"
    assert (out / "manifest.json").is_file()


def test_without_a_worker_wait_and_status_say_that_no_worker_is_listening(
    service: Service, small_raw: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    waiting = start_waiting(service, "prepare", str(small_raw), str(out))
    job = job_of(service, out)
    time.sleep(NO_WORKER_AFTER_S + 3)  # the few seconds, and the workers' (non-)answers
    _, stderr = interrupt(waiting)
    assert (
        "gpufeed: warning: no worker is listening on queue 'gpufeed', so the job waits: start one with gpufeed worker"
        in stderr
    ), stderr

    status = service.cli("status", job)
    assert status.returncode == 0, status.stderr
    assert f"job {job}  prepare  queued\n  no worker is listening on queue 'gpufeed'" in status.stdout
    doc = service.status(job)
    assert doc["state"] == "queued" and doc["queue"] == "gpufeed" and doc["listening_workers"] == []


def test_with_a_worker_listening_nobody_is_told_otherwise(service: Service, small_raw: Path, tmp_path: Path) -> None:
    service.start_worker("w1")
    service.start_worker("w2", "--queues", "elsewhere")  # listening, but not on the jobs' queue
    result = service.cli("submit", "prepare", str(small_raw), str(tmp_path / "out"), "--wait", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no worker is listening" not in result.stderr + result.stdout
    assert "succeeded" in result.stdout

    code = "import json, sys; from worker.client import listening_workers as l; print(json.dumps([l(q, 2.0) for q in sys.argv[1:]]))"
    asked = subprocess.run(
        [sys.executable, "-c", code, "gpufeed", "elsewhere", "nobody"], env=service.env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    on_jobs, on_elsewhere, on_nobody = json.loads(asked.stdout)
    assert [name.split("@")[0] for name in on_jobs] == ["w1"]
    assert [name.split("@")[0] for name in on_elsewhere] == ["w2"]
    assert on_nobody == []


def test_a_refused_rerun_names_the_options_that_differ(service: Service, small_raw: Path, tmp_path: Path) -> None:
    service.start_worker("w1")
    out = tmp_path / "out"
    assert service.cli("submit", "prepare", str(small_raw), str(out), "--size", "64", "--wait", timeout=120).returncode == 0
    refused = service.cli("submit", "prepare", str(small_raw), str(out), "--size", "32", "--upscale", "--wait", timeout=120)
    assert refused.returncode == 1 and "failed" in refused.stdout, refused.stdout + refused.stderr
    assert f"--size: 32 here, 64 in {out}/manifest.json" in refused.stdout, refused.stdout
    assert "--upscale: given here, not given in" in refused.stdout, refused.stdout
    record = next(record for record in service.store.list_jobs() if record.state == "failed")
    assert "resize.size: 32 here, 64 in" in record.error  # what a Python caller of the service reads
    as_json = json.loads(service.cli("status", str(record.id), "--json").stdout)
    assert "--size: 32 here, 64 in" in as_json["error"]


def test_status_and_cancel_take_an_unambiguous_start_of_the_id(service: Service, small_raw: Path, tmp_path: Path) -> None:
    store = service.store
    jobs: dict[str, str] = {}  # the first character of an id -> the first job whose id starts with it
    pair: tuple[str, str] | None = None
    for index in range(40):  # sixteen first characters: two ids share one soon
        job = service.submit("prepare", str(small_raw), str(tmp_path / f"out{index}"))
        if job[0] in jobs:
            pair = (jobs[job[0]], job)
            break
        jobs[job[0]] = job
    assert pair is not None
    first, second = pair
    shared = next(i for i in range(len(first)) if first[i] != second[i])

    ambiguous = service.cli("status", first[:shared])
    assert ambiguous.returncode == 1 and "Traceback" not in ambiguous.stderr
    assert ambiguous.stderr == (
        f"gpufeed: error: {first[:shared]!r} is the start of 2 job ids: {', '.join(sorted(pair))}; give more of the id\n"
    )
    as_json = service.cli("status", first[:shared], "--json")
    assert as_json.returncode == 1 and "is the start of 2 job ids" in json.loads(as_json.stdout)["error"]

    unique = first[: shared + 1]
    status = service.cli("status", unique)
    assert status.returncode == 0 and status.stdout.startswith(f"job {first}  prepare  queued"), status.stderr
    assert service.status(unique.upper())["job"] == first  # ids are hex: either case
    cancelled = service.cli("cancel", unique)
    assert cancelled.returncode == 0 and cancelled.stdout == f"job {first} cancelled; its partial shards are being removed (submit it again to resume)\n"
    assert store.require(first).state == "cancelled" and store.require(second).state == "queued"

    unknown = service.cli("status", "g00d")
    assert unknown.returncode == 1 and "no job 'g00d'" in unknown.stderr
