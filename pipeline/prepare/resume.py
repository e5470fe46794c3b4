"""What OUT already holds, so an interrupted or repeated prepare does only what is left.

A job's work lives in OUT/.gpufeed: the listing spill, `plan.json` (the
settings' identity, the listing's hash, the shard plan) and one small record
per written shard (the sizes and hashes of its files, its rejects). A shard is
complete when its record exists and every file it names still has the
recorded size (and, locally, sha256). The manifest is written last: once OUT
holds a manifest of the same settings the dataset is complete, and whatever
is left of the work folder is a leftover of a run that stopped just after.
A finished dataset is checked too: a shard file that is missing or has
another size than its manifest entry (with `verify`, another sha256) is
damaged, and a re-run writes it again (see `repair.py`).

`WorkFolder` owns all of it (the records, the temp-file sweeps, the checks of
what OUT holds); `OutRecords` caches the two reads every step starts with.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import JobConflictError, ManifestError, StorageError
from ..io.fs import at_once, file_sha256, process_alive, store_errors, store_failure
from ..io.output import Output, remove_temp_objects
from ..io.tar import ShardInfo
from ..manifest import MANIFEST_NAME, REJECTED_NAME, Manifest, parse_manifest
from ..specs import PrepareSpec
from ..units import format_bytes
from .lock import remove_lock as remove_lock  # the service imports it from here

T = TypeVar("T")

WORK_DIR = ".gpufeed"
PLAN_REL = f"{WORK_DIR}/plan.json"
_OUTPUT_NAME = re.compile(r"shard-\d{6}\.tar|v\d+")  # what a prepare writes at the top of OUT
_VARIANT_DIR = re.compile(r"v\d+")
# A publish moves its temp object within seconds; ten minutes leaves room for a
# slow server-side copy of a large shard, so a live writer's object is never taken.
STALE_TEMP_OBJECT_S = 600.0
STORE_THREADS = 16  # a remote OUT's shard records checked at once: each check is a few round trips
# What a prepare leaves in an OUT that holds no dataset: the reasons of a job whose every file was
# rejected, its work folder, a lock. Hidden names and a file system's lost+found are never written.
_OWN_WITHOUT_DATASET = frozenset({REJECTED_NAME, WORK_DIR, "lost+found"})


def set_prefixes(variants: int) -> list[tuple[int | None, str]]:
    """(variant, folder prefix) of every variant set: `v0/`, `v1/` ..., or one set at the top of OUT."""
    if variants:
        return [(v, f"v{v}/") for v in range(variants)]
    return [(None, "")]


def _shard_record_rel(shard: int) -> str:
    return f"{WORK_DIR}/shards/{shard:06d}.json"


class WorkFolder:
    """A prepare's view of OUT: its work folder (plan and shard records), its temp files, what else OUT holds.

    Args:
        output: OUT.
    """

    def __init__(self, output: Output) -> None:
        self.output = output

    # -- the plan and the shard records ------------------------------------

    def read_plan(self) -> dict[str, Any] | None:
        """The saved plan record of an unfinished job in OUT, or None when there is none."""
        text = self.output.read_if_exists(PLAN_REL)
        if text is None:
            return None
        record: dict[str, Any] = json.loads(text)
        return record

    def write_plan(self, record: dict[str, Any]) -> None:
        """Save the plan record (atomically: a reader sees the old one or the new one)."""
        self.output.write_bytes_atomic(PLAN_REL, json.dumps(record, indent=1).encode("utf-8"))

    def write_shard_record(
        self,
        shard: int,
        infos: list[ShardInfo],
        rejected: list[dict[str, str]],
        warned: int = 0,
        boxes_dropped: int = 0,
        frames_unclear: int = 0,
    ) -> dict[str, Any]:
        """Record a written shard: its files (one per variant set that got samples), its rejects, how many
        of its samples were decoded with warnings, and how many boxes its samples dropped (recorded only when
        some were). Returns the record, as `read_shard_record` reads it."""
        record = {"shard": shard, "shards": [info.to_dict() for info in infos], "rejected": rejected, "warned": warned}
        if boxes_dropped:
            record["boxes_dropped"] = boxes_dropped
        if frames_unclear:  # samples whose annotation's declared size matched neither frame
            record["frames_unclear"] = frames_unclear
        self.output.write_bytes_atomic(_shard_record_rel(shard), json.dumps(record).encode("utf-8"))
        return record

    def read_shard_record(self, shard: int) -> dict[str, Any]:
        """A written shard's record: `shards` (file dicts), `rejected` (source, reason) entries, `warned`
        (0 in records of older versions, which did not count)."""
        record: dict[str, Any] = json.loads(self.output.read_bytes(_shard_record_rel(shard)))
        return record

    def shard_record_or_none(self, shard: int) -> dict[str, Any] | None:
        """A shard's record, None when the shard has none."""
        try:
            return self.read_shard_record(shard)
        except FileNotFoundError:
            return None

    def shard_record_text(self, shard: int) -> bytes | None:
        """The bytes of a shard's record; None when the shard has none."""
        return self.output.read_if_exists(_shard_record_rel(shard))

    def has_shard_record(self, shard: int) -> bool:
        """Whether a run wrote and recorded the shard (its files are not checked: see `shard_is_complete`)."""
        return self.output.exists(_shard_record_rel(shard))

    def shard_is_complete(self, shard: int) -> bool:
        """Whether the shard was recorded and its files are still exactly what was recorded."""
        return self.recorded_files_intact(self.shard_record_text(shard))

    def recorded_files_intact(self, text: bytes | None) -> bool:
        """Whether a shard record's files (`text`, `shard_record_text`; None: no record) are still exactly what it records."""
        if text is None:
            return False
        for info in json.loads(text)["shards"]:
            if self.output.size(info["path"]) != info["bytes"]:
                return False
            # Locally a hash is cheap next to rewriting; remotely the size has to do.
            if self.output.is_local and file_sha256(self.output.local(info["path"]))[0] != info["sha256"]:
                return False
        return True

    def for_each_shard(self, shards: int, check: Callable[[int], T]) -> list[T]:
        """`check(shard)` for shards 0 .. shards-1, in order; on a remote OUT, STORE_THREADS at once.

        A store 20 ms away makes a finish that reads each shard's record and sizes one
        after another take seconds; the calls are independent, so they overlap.
        """
        if self.output.is_local or shards < 2:
            return [check(shard) for shard in range(shards)]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(STORE_THREADS, shards), thread_name_prefix="gpufeed-record") as pool:
            return list(pool.map(check, range(shards)))

    def pending_shards(self, shards: int) -> list[int]:
        """The planned shards (0 .. shards-1) that are not complete yet."""
        complete = self.for_each_shard(shards, self.shard_is_complete)
        return [shard for shard, done in enumerate(complete) if not done]

    def remove_shards(self, shards: list[int]) -> None:
        """Remove written shards: their files and their records (the plan stays, so they are pending again)."""
        for shard in shards:
            if self.has_shard_record(shard):
                for info in self.read_shard_record(shard)["shards"]:
                    self.output.remove(info["path"])
                self.output.remove(_shard_record_rel(shard))

    def read_rejects(self) -> list[dict[str, str]]:
        """The entries of a finished dataset's rejected.jsonl ([] when it has none)."""
        text = self.output.read_if_exists(REJECTED_NAME)
        return [json.loads(line) for line in (text or b"").splitlines() if line.strip()]

    # -- temp files --------------------------------------------------------

    def remove_stale_temp_files(self, variants: int) -> None:
        """Remove the temp files of shards an earlier run was writing when it stopped."""
        for _, prefix in set_prefixes(variants):
            directory = self.output.local(prefix) if prefix else self.output.staging
            if not os.path.isdir(directory):
                continue
            for name in os.listdir(directory):
                if _is_temp_shard(name):
                    os.unlink(os.path.join(directory, name))

    def remove_temp_files(self) -> None:
        """Remove every shard temp file in a local OUT, whatever the variant sets of the job that left it."""
        output = self.output
        if not output.is_local:
            return
        for prefix in [""] + [name for name in output.listdir() if _VARIANT_DIR.fullmatch(name)]:
            for name in output.listdir(prefix):
                if _is_temp_shard(name):
                    output.remove(f"{prefix}/{name}" if prefix else name)

    def remove_stale_temp_objects(self, manifest: Manifest) -> list[str]:
        """Remove the temp objects crashed writers left next to a finished dataset's files.

        Called once every shard is published (so no writer of this job still needs
        a temp object of its own): the temp names of the manifest's shard files, of
        rejected.jsonl and of the manifest go when older than STALE_TEMP_OBJECT_S;
        the work folder goes whole with `remove_work`.

        On a local OUT, the temp files of writers that are gone go instead (see
        `remove_dead_temp_files`): a worker killed in the middle of a shard leaves
        one, and the shard is written again by another.

        Returns:
            The members removed, relative to OUT.
        """
        if self.output.is_local:
            return self.remove_dead_temp_files()
        finals = [info.path for info in manifest.shards] + [REJECTED_NAME, MANIFEST_NAME]
        return remove_temp_objects(self.output, finals, older_than_s=STALE_TEMP_OBJECT_S)

    def remove_dead_temp_files(self) -> list[str]:
        """Remove the temp files in a local OUT (at its top and in its variant folders) whose writer is gone.

        A temp name ends in ``.tmp-HOST-PID`` (`temp_suffix`): one of this host
        goes when no process PID runs here; one of another host (OUT on a shared
        file system) when it was last written more than STALE_TEMP_OBJECT_S ago.
        Only temp names of what a prepare writes (shards, manifest.json,
        rejected.jsonl) are looked at. Returns the members removed, relative to OUT.
        """
        output, removed = self.output, []
        for prefix in [""] + [f"{name}/" for name in output.listdir() if _VARIANT_DIR.fullmatch(name)]:
            for name in output.listdir(prefix.rstrip("/")):
                path = output.local(prefix + name)
                if _is_temp_of_output(name) and _writer_gone(name, path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    removed.append(prefix + name)
        return removed

    # -- a finished dataset's shard files ----------------------------------

    def shard_file_problem(self, info: ShardInfo, *, verify: bool = False, sizes: dict[str, int] | None = None) -> str:
        """What is wrong with a finished dataset's shard file on disk, phrased to follow its name; "" when nothing.

        Cheap by default (the file is there with its recorded size); with
        `verify`, its sha256 is computed and compared too. `sizes`: OUT's files
        and sizes, listed once (`Output.file_sizes`), instead of asking for this one.
        """
        size = self.output.size(info.path) if sizes is None else sizes.get(info.path)
        if size is None:
            return "was missing"
        if size != info.bytes:
            return f"had {size} bytes, the manifest says {info.bytes}"
        if verify and self._sha256_of(info.path) != info.sha256:
            return "did not match its sha256"
        return ""

    def damaged_shards(self, manifest: Manifest, *, verify: bool = False) -> dict[str, str]:
        """The manifest's shard files that are missing or damaged in OUT: path -> what is wrong (see `shard_file_problem`).

        On a store, OUT is listed once for every shard's size (one request per
        thousand files, not one per shard).
        """
        sizes = None if self.output.is_local else self.output.file_sizes()
        problems = {info.path: self.shard_file_problem(info, verify=verify, sizes=sizes) for info in manifest.shards}
        return {path: problem for path, problem in problems.items() if problem}

    def _sha256_of(self, rel: str) -> str:
        if self.output.is_local:
            return file_sha256(self.output.local(rel))[0]
        digest = hashlib.sha256()
        with self.output.open_read(rel) as handle:
            while block := handle.read(4 * 1024 * 1024):
                digest.update(block)
        return digest.hexdigest()

    # -- what OUT holds besides the work -----------------------------------

    def finished_manifest(self, spec: PrepareSpec, records: OutRecords | None = None) -> Manifest | None:
        """OUT's manifest when OUT holds the finished dataset of exactly these settings, else None.

        `records`: what the caller read of OUT already.
        """
        try:
            manifest = (records or OutRecords(self.output)).manifest()
        except ManifestError:
            return None
        return manifest if manifest.params == spec.output_identity() else None

    def check_existing(self, spec: PrepareSpec, overwrite: bool, records: OutRecords | None = None) -> Manifest | None:
        """The existing manifest when OUT already holds this exact job, else None (OUT cleared when asked).

        `records`: what the caller read of OUT already (stale once OUT is cleared here).

        Raises:
            JobConflictError: OUT holds another job's dataset or unfinished work and
                `overwrite` is False (the message names each setting that differs), or
                OUT holds files but is no gpufeed dataset (whatever `overwrite` says).
        """
        identity = spec.output_identity()
        records = records or OutRecords(self.output)
        if records.manifest_text is not None:
            if overwrite:
                self.clear_output()
                return None
            try:
                manifest = records.manifest()
            except ManifestError as exc:
                raise JobConflictError(f"{exc}; choose another OUT or pass overwrite=True to replace it") from exc
            if manifest.params == identity:
                return manifest
            differences = setting_differences(identity, manifest.params, f"{spec.out.rstrip('/')}/{MANIFEST_NAME}")
            raise JobConflictError(
                f"{spec.out} already holds a dataset prepared with different settings{_conflict(differences)}; "
                "choose another OUT or pass overwrite=True to replace it"
            )
        plan = records.plan
        if plan is None:
            self.refuse_foreign_output(spec.out)
        if plan is not None and plan.get("identity") != identity:
            if not overwrite:
                differences = setting_differences(identity, plan.get("identity") or {}, "the unfinished prepare")
                raise JobConflictError(
                    f"{spec.out} holds an unfinished prepare with different settings{_conflict(differences)}; "
                    "re-run that command to finish it, choose another OUT, or pass overwrite=True"
                )
            self.clear_output()
        return None

    def foreign_entries(self) -> list[str]:
        """What OUT holds that no prepare wrote, when OUT holds no manifest (sorted names at its top).

        [] when there is none, or when OUT shows that a prepare was writing it: its work
        folder, temp files of its shards or manifest (a run that died before its plan), or
        nothing but names a prepare writes (``shard-000000.tar``, ``v0/``). Else every name
        (the shard-like ones too: they would be written over).
        """
        output = self.output
        if output.is_local:
            names = output.listdir()
        else:  # one listing: `listdir` would ask whether OUT is a folder first
            try:
                names = [str(path).rstrip("/").rsplit("/", 1)[-1] for path in output.fs.ls(output._fresh(""), detail=False)]
            except FileNotFoundError:
                return []
            except store_errors() as exc:
                raise store_failure("list", output.url, exc) from exc
        if any(name == WORK_DIR or _is_own_temp(name) for name in names):
            return []  # a prepare was here (its work folder, or what its writers left when they died): its OUT
        shown = sorted(name for name in names if name not in _OWN_WITHOUT_DATASET and not name.startswith("."))
        if all(_OUTPUT_NAME.fullmatch(name) for name in shown):
            return []  # only what a prepare writes: the shards of one whose work folder was lost (a store emptied mid-job)
        return shown

    def refuse_foreign_output(self, out: str) -> None:
        """Refuse an OUT that holds files but no gpufeed dataset (no manifest, no unfinished prepare): never written over.

        Raises:
            JobConflictError: naming what OUT holds; `--overwrite` does not apply (it replaces gpufeed datasets only).
        """
        foreign = self.foreign_entries()
        if not foreign:
            return
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise JobConflictError(
            f"{out} is not a gpufeed dataset (no {MANIFEST_NAME}, no unfinished prepare) but holds {shown}; "
            "nothing was written: prepare into an empty or new folder (overwrite=True replaces only a gpufeed dataset)"
        )

    def clear_output(self) -> None:
        """Remove everything a prepare writes to OUT (and nothing else that lives there)."""
        for name in self.output.listdir():
            if name in (MANIFEST_NAME, REJECTED_NAME, WORK_DIR) or _OUTPUT_NAME.fullmatch(name):
                self.output.remove(name)

    def remove_work(self) -> None:
        """Remove the work folder (and a remote OUT's local staging copy) once the manifest is written.

        On a store, the multipart uploads that failed uploads left in progress under OUT are
        aborted too, as far as the store lets them be (they are invisible, but stored and billed).
        """
        output = self.output
        if output.is_local:
            output.remove(WORK_DIR)
            return

        def abort_uploads() -> None:
            with contextlib.suppress(StorageError):
                output.abort_uploads()

        at_once(functools.partial(output.remove, WORK_DIR), abort_uploads)  # independent round trips: side by side
        shutil.rmtree(output.staging, ignore_errors=True)


def _is_temp_of_output(name: str) -> bool:
    final = name.partition(".tmp-")[0]
    return _is_temp_shard(name) or final in (MANIFEST_NAME, REJECTED_NAME)


def _writer_gone(name: str, path: str) -> bool:
    import socket
    import time

    host, _, pid = name.partition(".tmp-")[2].rpartition("-")
    if host == socket.gethostname() and pid.isdigit():
        return not process_alive(int(pid))
    try:
        return os.path.getmtime(path) < time.time() - STALE_TEMP_OBJECT_S
    except OSError:
        return False


def _is_temp_shard(name: str) -> bool:
    return name.startswith(".shard-") and ".tmp-" in name


def _is_own_temp(name: str) -> bool:
    """A temp name of a file a prepare writes (``.shard-000000.tar.tmp-HOST-PID``, ``manifest.json.tmp-…``)."""
    final, marker, _ = name.partition(".tmp-")
    final = final[1:] if final.startswith(".") else final
    return bool(marker) and (bool(_OUTPUT_NAME.fullmatch(final)) or final in (MANIFEST_NAME, REJECTED_NAME))


class OutRecords:
    """OUT's manifest.json and plan record, each read from OUT once, when first asked for.

    A step of a job (plan, a shard, the finish) asks several questions of the
    two; on a store each read is a round trip. Make a new one after OUT changes.
    """

    def __init__(self, output: Output) -> None:
        self.output = output

    def read_both(self) -> OutRecords:
        """Read the plan and the manifest now, at once (two requests, one round trip on a store)."""
        if not self.output.is_local:
            at_once(lambda: self.plan, lambda: self.manifest_text)
        return self

    @functools.cached_property
    def plan(self) -> dict[str, Any] | None:
        """The plan record of an unfinished job (`WorkFolder.read_plan`), or None."""
        return WorkFolder(self.output).read_plan()

    @functools.cached_property
    def manifest_text(self) -> bytes | None:
        """The bytes of manifest.json, or None when there is none."""
        return self.output.read_if_exists(MANIFEST_NAME)

    def manifest(self) -> Manifest:
        """The manifest, validated (`read_manifest`).

        Raises:
            ManifestError: missing, not JSON, or not a gpufeed manifest.
        """
        return parse_manifest(self.manifest_text, self.output.url)

    def recorded_source(self) -> str | None:
        """The SRC that OUT's unfinished prepare, or else its dataset, records; None when OUT holds neither.

        The plan comes first: an unfinished job's plan records the SRC its manifest
        will (a repair's plan, the manifest's), and a shard step then needs no
        other read.
        """
        if self.plan is not None:
            source = (self.plan.get("identity") or {}).get("source")
        elif self.manifest_text is not None:
            try:
                source = self.manifest().params.get("source")
            except ManifestError:
                return None
        else:
            return None
        return source if isinstance(source, str) else None


def setting_differences(here: dict[str, Any], recorded: dict[str, Any], where: str) -> list[str]:
    """Every setting in which two jobs' identities differ, named as a PrepareSpec's fields.

    Args:
        here: this job's `PrepareSpec.output_identity()`.
        recorded: the identity OUT records (a manifest's params, a plan's identity).
        where: what holds `recorded`, as the message names it (`shards/manifest.json`).

    Returns:
        One line per setting, its dotted path and its two values, e.g.
        `resize.size: 256 here, 224 in shards/manifest.json` (`nothing recorded`: a
        setting one of them lacks). The CLI spells them as its options
        (`pipeline.cli.common.with_prepare_option_names`).
    """
    mine, theirs = _flatten(here), _flatten(recorded)
    keys = list(mine) + [key for key in theirs if key not in mine]
    return [
        f"{key}: {_shown(key, mine, key in mine)} here, "
        f"{_shown(key, theirs, key in theirs)} in {where}"
        for key in keys
        if (key in mine, mine.get(key)) != (key in theirs, theirs.get(key))
    ]


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _shown(key: str, values: dict[str, Any], present: bool) -> str:
    if not present:
        return "nothing recorded"
    value = values[key]
    if key == "shards.max_bytes" and isinstance(value, int):
        return format_bytes(value, exact=True)
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    return str(value)


def _conflict(differences: list[str]) -> str:
    return f" ({'; '.join(differences)})" if differences else ""



def planned_conflict(spec: PrepareSpec, planned: dict[str, Any]) -> JobConflictError:
    """The error for a step of a job whose OUT holds a planned prepare of other settings (`planned`: its identity)."""
    differences = setting_differences(spec.output_identity(), planned, "the planned prepare")
    return JobConflictError(f"{spec.out} holds a planned prepare with different settings{_conflict(differences)}")
