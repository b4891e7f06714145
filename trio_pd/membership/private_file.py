"""Who may write a membership file: the router's own user or root, nobody else.

A `--membership-file` or `--discovery-file` names the workers, and a worker receives users'
prompts and, with `--api-key`, the router's key: whoever can rewrite the file gets both (issue 26
N12: uid 65534 rewrote a 0666 manifest). So the file, the directory it is named in and, when it is
a symlink (a Kubernetes ConfigMap's `..data/` links), the directory of the file it resolves to
must each be owned by the router's user or root and not writable by group or others. Exceptions,
where the bits do not let anyone else write: a directory with the sticky bit (as /tmp: others
cannot replace a file they do not own), and a file system mounted read-only (a ConfigMap volume,
whose mount point shows 0777). Checked at start (a usage error) and before every read
(`shared_file.py`: the last good set stays, the source is reported down, the error names the
path and its mode).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeFile(ValueError):
    """A membership file (or its directory) someone other than the router or root may write."""


def check_private(path: Path) -> None:
    """Raise UnsafeFile naming the path, its owner and mode when another user could rewrite
    `path`; a missing file passes (reading it fails on its own)."""
    try:
        real = path.resolve(strict=True)
    except OSError:
        return
    named_dir = path.absolute().parent
    for checked in dict.fromkeys((real, real.parent, named_dir)):
        _check_one(checked, path)


def _check_one(checked: Path, named: Path) -> None:
    try:
        info = checked.stat()
    except OSError:
        return
    what = "its directory " if checked != named.resolve() else ""
    shown = f"{named}" if not what else f"{named}: {what}{checked}"
    owner = info.st_uid
    if owner not in (0, os.geteuid()):
        raise UnsafeFile(
            f"membership file {shown} is owned by uid {owner}, neither this router's "
            f"({os.geteuid()}) nor root's: another user could name the workers"
        )
    mode = stat.S_IMODE(info.st_mode)
    if not mode & 0o022:
        return
    if stat.S_ISDIR(info.st_mode) and mode & stat.S_ISVTX:
        return  # sticky: others may add files, not replace ours
    if _read_only(checked):
        return
    raise UnsafeFile(
        f"membership file {shown} has mode {mode:04o}: writable by "
        f"{'group and others' if mode & 0o022 == 0o022 else 'group' if mode & 0o020 else 'others'}"
        f"; make it writable by its owner only (chmod go-w)"
    )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
