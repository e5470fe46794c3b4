"""What a submitted job may touch, checked at submission and again in the worker.

A job names paths (SRC, OUT, a dataset, a disk to benchmark). Each must lie
under one of GPUFEED_ALLOWED_ROOTS once `..` is refused and symlinks are
resolved; URL paths must start with an allowed URL prefix. Specs are
validated by the library's own spec classes, so a bad job gets the same
clear message as a bad `gpufeed prepare` flag.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from pipeline.errors import ConfigError
from pipeline.io.fs import local_path, redact_url, url_credential, url_secrets
from pipeline.redact import find_credentials

from .settings import ServiceSettings

JOB_KINDS = ("prepare", "reshard", "bench-disk")
MAX_PATH_CHARS = 4096


def require_roots(roots: Iterable[str]) -> tuple[str, ...]:
    roots = tuple(roots)
    if not roots:
        raise ConfigError(
            "GPUFEED_ALLOWED_ROOTS is not set, so the service accepts no job: set it, for the submitter and the "
            "workers alike, to the folders jobs may read and write (e.g. GPUFEED_ALLOWED_ROOTS=/data:/shards)"
        )
    return roots


def _check_text(path: Any, what: str) -> str:
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{what} must be a non-empty path")
    if len(path) > MAX_PATH_CHARS or any(ord(c) < 32 for c in path):
        raise ConfigError(f"{what} is not a usable path (too long or has control characters)")
    secrets = url_secrets(path)
    if secrets:  # a job record, its logs and `gpufeed status` would hold them
        raise ConfigError(
            f"{what} {redact_url(path)!r} holds {' and '.join(secrets)}, which may be a credential and a job never "
            "records: give the URL without it; credentials come from each worker's environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws)"
        )
    parts = path.split("://", 1)[-1].replace("\\", "/").split("/")
    if ".." in parts:
        raise ConfigError(f"{what} {redact_url(path)!r} contains '..'; give the path without it")
    return path


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_path(path: Any, roots: Iterable[str], what: str) -> str:
    """Refuse `path` unless it lies under an allowed root; returns it unchanged.

    Local paths must be absolute; symlinks are resolved on both sides, so a
    link inside a root that leads outside it is refused.

    Raises:
        ConfigError: the path is malformed, relative, contains `..`, or lies outside every root.
    """
    roots = require_roots(roots)
    path = _check_text(path, what)
    local = local_path(path)
    if local is None:
        allowed = any("://" in root and _inside(path, root) for root in roots)
    else:
        if not os.path.isabs(local):
            raise ConfigError(f"{what} {redact_url(path)!r} is relative; jobs need absolute paths")
        real = os.path.realpath(local)
        allowed = any("://" not in root and _inside(real, os.path.realpath(root)) for root in roots)
    if not allowed:
        raise ConfigError(f"{what} {redact_url(path)!r} is outside GPUFEED_ALLOWED_ROOTS ({', '.join(roots)}); the service may not touch it")
    return path


def absolute(path: Any, what: str = "path") -> Any:
    """A local path made absolute from this process's folder (URLs and non-strings unchanged).

    `..` is refused first: `os.path.abspath` would silently fold it away.
    """
    if not isinstance(path, str) or local_path(path) is None or path.startswith("file://"):
        return path
    _check_text(path, what)
    return os.path.abspath(os.path.expanduser(path))


def check_payload_size(payload: dict[str, Any], settings: ServiceSettings) -> None:
    size = len(json.dumps(payload))
    if size > settings.max_spec_bytes:
        raise ConfigError(f"the job spec is {size} bytes; the service accepts at most {settings.max_spec_bytes}")


def _check_bool(payload: dict[str, Any], name: str) -> bool:
    value = payload.get(name, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


_NO_CREDENTIALS = (
    "a job never records a credential: give it without, and the credentials to the workers through their "
    "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws)"
)


def check_no_credentials(value: Any, where: str = "", extra: Callable[[str], str | None] | None = None) -> None:
    """Refuse a job's value that holds a credential anywhere in it (see `pipeline.redact.find_credentials`).

    Args:
        value: the job's payload, or a part of it.
        where: the path of `value` in the job (``storage_options``); "" for the payload itself.
        extra: a further check of each string (what credential it holds, or None).

    Raises:
        ConfigError: naming each field that holds one (never its value), or a value nested too deep.
    """
    try:
        found = sorted(find_credentials(value, where, extra))
    except ValueError as exc:  # nested past any job's shape
        raise ConfigError(f"the job spec: {exc}") from None
    if found:
        shown = "; ".join(f"{path} holds {what}" for path, what in found[:5])
        more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
        raise ConfigError(f"{shown}{more}: {_NO_CREDENTIALS}")


def check_storage_options(options: Any) -> dict[str, Any]:
    """A job's store settings, refused when one is a credential: a job record never holds a secret.

    Non-secret fsspec options (``endpoint_url``, ``anon``, ``profile``, ``region_name`` …)
    travel with the job; credentials come from each worker's own environment
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws``). At any
    depth (``client_kwargs``, ``headers``), a setting named like a credential (``key``,
    ``secret_key``, ``Authorization``, ``sas_token`` …) or a value of a credential's format
    (an AWS key id, an Azure connection string, a bearer token, a private key, a URL with
    ``NAME:PASSWORD@`` or a query string …) is refused.

    Raises:
        ConfigError: not a JSON object, or an option holds a credential (its path named, its value never shown).
    """
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise ConfigError("a job's storage options must be a JSON object of KEY: VALUE")
    check_no_credentials(options, "storage_options", url_credential)
    return dict(options)


def validate_job(kind: str, payload: Any, settings: ServiceSettings) -> dict[str, Any]:
    """Check a job spec and every path in it; returns the normalised payload.

    Raises:
        ConfigError: with a message that says what to fix.
    """
    if kind not in JOB_KINDS:
        raise ConfigError(f"unknown job kind {kind!r} (expected one of {', '.join(JOB_KINDS)})")
    if not isinstance(payload, dict):
        raise ConfigError("a job spec must be a JSON object")
    check_no_credentials(payload)
    check_payload_size(payload, settings)
    roots = settings.allowed_roots
    if kind == "prepare":
        unknown = set(payload) - {"spec", "force", "overwrite", "storage_options"}
        if unknown:
            raise ConfigError(f"prepare job: unknown field(s) {', '.join(sorted(unknown))}")
        from pipeline.specs import PrepareSpec

        spec = PrepareSpec.from_dict(payload.get("spec"))
        check_path(spec.source, roots, "SRC")
        check_path(spec.out, roots, "OUT")
        check_input_limits(spec, settings)
        checked = {"spec": spec.to_dict(), "force": _check_bool(payload, "force"), "overwrite": _check_bool(payload, "overwrite")}
        if payload.get("storage_options"):
            checked["storage_options"] = check_storage_options(payload["storage_options"])
        return checked
    if kind == "reshard":
        if set(payload) - {"spec"}:
            raise ConfigError(f"reshard job: unknown field(s) {', '.join(sorted(set(payload) - {'spec'}))}")
        from pipeline.prepare.reshard import ReshardSpec

        reshard = ReshardSpec.from_dict(payload.get("spec"))
        check_path(reshard.dataset, roots, "DATASET")
        if reshard.out is not None:
            check_path(reshard.out, roots, "--out")
        return {"spec": reshard.to_dict()}
    unknown = set(payload) - {"path", "options"}
    if unknown:
        raise ConfigError(f"bench-disk job: unknown field(s) {', '.join(sorted(unknown))}")
    return {"path": check_path(payload.get("path"), roots, "PATH"), "options": _bench_options(payload.get("options"))}


# Options a submitted disk benchmark may set, with their bounds: a job may not fill a disk or run for hours.
BENCH_OPTIONS = {"file_bytes": (1 << 20, 64 << 30), "duration_s": (0.1, 600.0), "threads": (1, 256)}


def _bench_options(options: Any) -> dict[str, Any]:
    options = options or {}
    if not isinstance(options, dict):
        raise ConfigError("bench-disk options must be a JSON object")
    unknown = set(options) - set(BENCH_OPTIONS)
    if unknown:
        raise ConfigError(f"bench-disk: unknown option(s) {', '.join(sorted(unknown))} (allowed: {', '.join(BENCH_OPTIONS)})")
    for name, value in options.items():
        low, high = BENCH_OPTIONS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ConfigError(f"bench-disk: {name} must be a number between {low} and {high}, got {value!r}")
        if name != "duration_s" and not isinstance(value, int):
            raise ConfigError(f"bench-disk: {name} must be a whole number, got {value!r}")
    return dict(options)


def check_input_limits(spec: Any, settings: ServiceSettings) -> None:
    """A job may lower the image and file size limits, never raise them past the service's."""
    if spec.max_pixels > settings.max_pixels:
        raise ConfigError(
            f"--max-pixels {spec.max_pixels} is over this service's limit of {settings.max_pixels} (GPUFEED_MAX_PIXELS)"
        )
    if spec.max_file_bytes > settings.max_file_bytes:
        raise ConfigError(
            f"max_file_bytes {spec.max_file_bytes} is over this service's limit of {settings.max_file_bytes} (GPUFEED_MAX_FILE_BYTES)"
        )


def job_paths(kind: str, payload: dict[str, Any]) -> list[str]:
    """The output paths a job writes, which no two running jobs may share."""
    if kind == "prepare":
        return [payload["spec"]["out"]]
    if kind == "reshard":
        spec = payload["spec"]
        return [spec["dataset"]] + ([spec["out"]] if spec.get("out") else [])
    return []


def lock_name(path: str) -> str:
    """One name per place: symlinks resolved and trailing slashes dropped."""
    local = local_path(path)
    if local is None:
        return path.rstrip("/")
    return os.path.realpath(local)


def listed_source_check(source: str, roots: Iterable[str]) -> Callable[[str], None] | None:
    """How a job's plan keeps what SRC lists inside the roots.

    A local folder (itself inside a root) can only lead outside through a
    symlink: its tree is walked here, at once, and there is nothing left to
    check (None). A list file (CSV/JSONL) or a URL can name anything: the
    check of one listed file's URL is returned, and the plan calls it on each
    file as it lists SRC (`plan_prepare(check_source=...)`), so a store's
    million objects are listed once, not once to check and once to plan.

    Raises:
        ConfigError: a symlink in the local folder leads outside the roots.
    """
    roots = require_roots(roots)
    local = local_path(source)
    if local is not None and os.path.isdir(local):
        _check_source_tree(local, roots, source)
        return None

    def check(url: str) -> None:
        try:
            check_path(url, roots, "a listed source file")
        except ConfigError as exc:
            if url_secrets(url):
                raise ConfigError(f"SRC {redact_url(source)} lists a file the service may not read: {exc}") from exc
            raise ConfigError(f"SRC {redact_url(source)} lists {redact_url(url)!r}, which is outside GPUFEED_ALLOWED_ROOTS") from exc

    return check


def opened_source_check(roots: Iterable[str]) -> Callable[[str], None]:
    """How a shard task keeps what it opens inside the roots: the check of one file it would read.

    The plan checked SRC's files, but a shard task reads the plan's listing from OUT, which may
    have changed since (lines added or edited, a link put where a file was); so the task checks
    every file (and mask) again as it takes it from the listing, links resolved
    (`pipeline.prepare.options.CheckedListing`). A refused file is rejected with this message,
    and never opened.

    Raises:
        ConfigError: GPUFEED_ALLOWED_ROOTS is not set (the returned check raises it for a file outside them).
    """
    roots = require_roots(roots)

    def check(url: str) -> None:
        check_path(url, roots, "a listed source file")

    return check


def _check_source_tree(top: str, roots: tuple[str, ...], source: str) -> None:
    pending, seen = [top], set()
    while pending:
        folder = pending.pop()
        try:
            info = os.stat(folder)
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            entries = list(os.scandir(folder))
        except OSError:
            continue  # the listing reports unreadable folders itself
        for entry in entries:
            if entry.name.startswith("."):
                continue  # never listed
            if entry.is_symlink():
                try:
                    check_path(entry.path, roots, "a file in SRC")
                except ConfigError as exc:
                    target = os.path.realpath(entry.path)
                    raise ConfigError(f"SRC {source} holds {entry.path!r}, a link to {target!r} outside GPUFEED_ALLOWED_ROOTS") from exc
            if entry.is_dir():
                pending.append(entry.path)
