"""Membership in one JSON file every process reads: `--workers N`, or a Kubernetes ConfigMap.

With `--workers N` the parent process writes the command line's workers into a file in a private
run directory and every router process runs a `FileMembership` on it: `POST /workers` and
`DELETE /workers/{id}` on any process rewrite the file (under an flock, atomically: a temporary
file renamed over it), and every process notices the change within `poll_secs` and reconciles
its Fleet, so ids and `GET /workers` agree everywhere. `--membership-file PATH` points a router
at a file the operator manages instead (a mounted ConfigMap: then read-only, and the admin API
answers 503 for changes).

The file:
    {"version": 1,
     "serial": {"prefill": 2, "decode": 1},        # numbers handed out so far (never reused)
     "workers": [{"id": "prefill-1", "url": "http://...", "worker_type": "prefill",
                  "bootstrap_port": 8998, "model_id": null, "api_key": null,
                  "admin_api_key": null}, ...]}
Worker ids of a hand-written file may be anything unique; missing ids are derived from the URL.
Nothing is read from a file another user could write (`private_file.py`): the last good view
stays and the source is down. Each entry is checked as `POST /workers` checks its body
(`worker_json.py`); a bad one is
skipped with a warning naming it (once per change of the file), the others are used. A file
that cannot be parsed keeps the last good view, and the admin API answers 503 for changes (the
error log says why) until it is mended.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import trio

from trio_pd.membership.private_file import UnsafeFile, check_private
from trio_pd.membership.source import StoreUnavailable
from trio_pd.membership.worker_json import spec_from_json
from trio_pd.spec import Registry, WorkerRecord, WorkerSpec

log = logging.getLogger("trio_pd.membership.file")
SOURCE = "file"
POLL_SECS = 0.25
RESYNC_SECS = 30.0


def spec_json(worker_id: str, spec: WorkerSpec) -> dict[str, Any]:
    return {
        "id": worker_id,
        "url": spec.url,
        "worker_type": spec.role,
        "bootstrap_port": spec.bootstrap_port,
        "model_id": spec.model_id,
        "api_key": spec.api_key,
        "admin_api_key": spec.admin_api_key,
        # only when not the default: SGLang workers' entries stay as they were
        **({"engine": spec.engine} if spec.engine != "sglang" else {}),
    }


CheckSpec = Callable[[WorkerSpec], None]  # a ValueError when a worker may not be listed


def parse_workers(
    data: Any, source: str = SOURCE, check: CheckSpec | None = None
) -> list[WorkerRecord]:
    """The usable records of a membership document (see `read_workers`)."""
    return read_workers(data, source, check)[0]


def read_workers(
    data: Any, source: str = SOURCE, check: CheckSpec | None = None
) -> tuple[list[WorkerRecord], list[str]]:
    """The records of a membership document, and what was wrong with each entry skipped.

    An entry is checked as the admin API checks `POST /workers` (`worker_json.py`): a
    hand-edited entry without a scheme, with a CR/LF in its key or a port 99999 is skipped,
    not routed to; so is one `check` refuses (where a worker may point, `upstream/urls.py`
    `refuse_listed`). A document that is not an object with a `workers` list, or whose usable
    entries share an id, is a ValueError: then nothing of it is used."""
    if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
        raise ValueError("a membership file is an object with a `workers` list")
    records, skipped = [], []
    for n, item in enumerate(data["workers"], 1):
        try:
            if not isinstance(item, dict):
                raise ValueError("an entry must be an object")
            worker_id = item.get("id")
            if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
                raise ValueError("id must be a non-empty string or absent")
            spec = spec_from_json(item)
            if check is not None:
                check(spec)
        except ValueError as exc:
            named = f" (id {item['id']!r})" if isinstance(item, dict) and item.get("id") else ""
            skipped.append(f"entry {n}{named} skipped: {exc}")
            continue
        records.append(WorkerRecord(worker_id or f"{spec.role}-{spec.url}", spec, source))
    ids = [r.id for r in records]
    if len(ids) != len(set(ids)):
        raise ValueError("worker ids in a membership file must be unique")
    return records, skipped


def same_worker(entry: Any, spec: WorkerSpec) -> bool:
    """Whether a file entry (maybe a bad one) names `spec`'s URL and role."""
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
        return False
    return entry["url"].rstrip("/") == spec.url and entry.get("worker_type") == spec.role


def write_atomically(path: Path, data: Any) -> None:
    """Replace `path` with `data` as JSON: readers see the old file or the new one, never half.

    The file may hold worker API keys: it is created readable by its owner only."""
    fd, tmp = tempfile.mkstemp(prefix=".membership-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def seed(path: Path, specs: Iterable[WorkerSpec]) -> None:
    """Add the command line's workers to `path` (created if missing); the parent of
    `--workers N` calls this before starting the router processes."""
    data: dict[str, Any] = {"version": 1, "serial": {}, "workers": []}
    if path.exists():
        data = json.loads(path.read_text())
        parse_workers(data)
    serial = data.setdefault("serial", {})
    for spec in specs:
        if any(same_worker(w, spec) for w in data["workers"]):
            continue
        serial[spec.role] = serial.get(spec.role, 0) + 1
        data["workers"].append(spec_json(f"{spec.role}-{serial[spec.role]}", spec))
    write_atomically(path, data)


class Unreadable(Exception):
    """The file is not a membership document (a bad hand edit, a truncated write)."""


class FileMembership:
    """A MembershipSource (watching the file) and a MembershipStore (writing it).

    ``on_error(kind)``, when given, is called for each failure: "read" (the file could not be
    read or parsed: the last good view stays), "write" (an admin change could not be stored).
    """

    def __init__(
        self,
        path: Path,
        registry: Registry,
        *,
        poll_secs: float = POLL_SECS,
        resync_secs: float = RESYNC_SECS,
        on_error: Callable[[str], None] | None = None,
        name: str = SOURCE,
        read: Callable[[Any], Any] | None = None,
        check: CheckSpec | None = None,
    ) -> None:
        """`name`: the source its workers carry; `read`: turns the file's JSON into a
        membership document first (`manifest.smg_manifest`: SMG's discovery manifest);
        `check`: refuses an entry no worker may be (its destination), as the admin API would."""
        self.name = name
        self.read = read
        self.check = check
        self.path = Path(path)
        self.on_error = on_error
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.registry = registry
        self.poll_secs = poll_secs
        self.resync_secs = resync_secs
        self._records: dict[str, WorkerRecord] = {}
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) last read
        self._skipped: list[str] = []  # the bad entries last reported
        self._unsafe: str | None = None  # why the file is not read (others may write it)

    # -- source -----------------------------------------------------------------------------

    async def run(
        self, registry: Registry, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.registry = registry
        self._refresh(force=True)
        task_status.started()
        last_resync = trio.current_time()
        while True:
            await trio.sleep(self.poll_secs)
            force = trio.current_time() - last_resync >= self.resync_secs
            if force:
                last_resync = trio.current_time()
            self._refresh(force=force)

    def _refresh(self, *, force: bool) -> None:
        """Read the file when it changed (or `force`) and reconcile; keep the last good view
        when it cannot be read (a bad edit must not empty the fleet)."""
        try:
            stat = self.path.stat()
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if seen == self._seen and not force and self._unsafe is None:
                return
            check_private(self.path)
        except UnsafeFile as exc:
            self._refuse_unsafe(str(exc))
            return
        except OSError:
            pass  # the read below fails and says so
        else:
            self._unsafe = None
        try:
            data = json.loads(self.path.read_bytes())
            if self.read is not None:
                data = self.read(data)
            records, skipped = read_workers(data, self.name, self.check)
        except (OSError, ValueError) as exc:
            self._count("read")
            self.registry.source_status(self.name, False, f"{self.path}: {exc}")
            return
        self._seen = seen
        self._report_skipped(skipped)
        self._apply(records)
        self.registry.source_status(self.name, True)

    def _refuse_unsafe(self, problem: str) -> None:
        """Another user could have written the file: nothing of it is read (the last good set
        stays), the source is down, the error logged once per problem and counted."""
        self._count("unsafe")
        self.registry.source_status(self.name, False, problem)
        if problem != self._unsafe:
            log.error("%s; it is not read until that is fixed", problem)
        self._unsafe = problem

    def _report_skipped(self, skipped: list[str]) -> None:
        """A warning for each bad entry, once: again only after the set of them changed."""
        if skipped == self._skipped:
            return
        self._skipped = skipped
        for problem in skipped:
            log.warning("membership file %s: %s", self.path, problem)
            self._count("bad_entry")

    def _count(self, kind: str) -> None:
        if self.on_error is not None:
            try:
                self.on_error(kind)
            except Exception:
                log.exception("membership file on_error callback failed")

    def _apply(self, records: list[WorkerRecord]) -> None:
        self._records = {r.id: r for r in records}
        self.registry.reconcile(self.name, records)

    # -- store ------------------------------------------------------------------------------

    def records(self) -> Mapping[str, WorkerRecord]:
        return dict(self._records)

    async def add(self, spec: WorkerSpec) -> WorkerRecord:
        def change(data: dict[str, Any]) -> str:
            for w in data["workers"]:
                if same_worker(w, spec):
                    raise ValueError(
                        f"{spec.role} worker {spec.url} is already registered as {w.get('id')}"
                    )
            serial = data.setdefault("serial", {})
            ids = {w.get("id") for w in data["workers"] if isinstance(w, dict)}
            number = serial.get(spec.role, 0) + 1
            while f"{spec.role}-{number}" in ids:  # a hand-written file may use our pattern
                number += 1
            serial[spec.role] = number
            worker_id = f"{spec.role}-{number}"
            data["workers"].append(spec_json(worker_id, spec))
            return worker_id

        worker_id = await self._update(change)
        return self._records[worker_id]

    async def remove(self, worker_id: str) -> WorkerRecord:
        if worker_id not in self._records:
            raise KeyError(worker_id)
        removed: list[WorkerRecord] = []

        def change(data: dict[str, Any]) -> str:
            kept = [
                w for w in data["workers"] if not isinstance(w, dict) or w.get("id") != worker_id
            ]
            if len(kept) == len(data["workers"]):
                raise KeyError(worker_id)
            removed.append(self._records[worker_id])
            data["workers"] = kept
            return worker_id

        await self._update(change)
        return removed[0]

    async def _update(self, change: Any) -> str:
        """Read-modify-write under an flock (in a thread: the lock may wait on another
        process), then reconcile this process at once; the others follow within a poll."""
        try:
            result, records = await trio.to_thread.run_sync(self._locked_update, change)
        except (OSError, Unreadable) as exc:
            self._count("write")
            log.error("membership file %s: %s; changes are refused until it is fixed", self.path,
                      exc)  # fmt: skip
            raise StoreUnavailable(f"membership file {self.path}: {exc}") from exc
        self._seen = None  # our own write: read it back on the next poll too
        self._apply(records)
        return result

    def _locked_update(self, change: Any) -> tuple[str, list[WorkerRecord]]:
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    check_private(self.path)
                    data = json.loads(self.path.read_bytes())
                    parse_workers(data)
                except ValueError as exc:  # not a "conflict": the file must be mended first
                    raise Unreadable(f"cannot be parsed ({exc})") from exc
                result = change(data)
                write_atomically(self.path, data)
                return result, parse_workers(data, self.name, self.check)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
