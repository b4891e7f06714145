"""A baseline router from another commit, for benchmarks that compare before and after in the
same run: the commit's tree extracted with `git archive` into a temporary directory (nothing is
registered in the repository: no worktree, no branch) and started with this venv's Python, its
own code first on the path (run it with the tree as its working directory: `python -m` puts the
working directory first on the path, and this checkout's `trio_pd` must not be found there).

    with baseline_tree("d07b3a9") as tree:
        Proc("router-before", [*baseline_command(), "serve", ...], logdir,
             env=baseline_env(tree), cwd=tree)
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.harness.output import ROOT

# The last commit before issue 19's memory bounds (admission before the body, the budget, the
# linear SSE reader): what "before" means in bench/memory.py and bench/hostile_stream.py.
BEFORE_BOUNDS = "d07b3a9"


@contextlib.contextmanager
def baseline_tree(rev: str) -> Iterator[Path]:
    """`rev`'s source tree in a temporary directory (removed afterwards)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "trio_pd"],
        capture_output=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix=f"trio-pd-{rev}-"))
    try:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(path, filter="data")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def baseline_command() -> list[str]:
    """`trio-pd` (pass the subcommand and flags after it): with `baseline_env`, the tree's."""
    return [sys.executable, "-m", "trio_pd"]


def baseline_env(tree: Path) -> dict[str, str]:
    """The environment that makes `import trio_pd` find the tree before this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tree), env.get("PYTHONPATH"))))
    return env
