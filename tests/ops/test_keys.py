"""Control-plane keys holding `,` or `;`, and keys from the environment (issue 19, item 11).

`--control-plane-api-keys` takes one entry per argument or a `,`/`;` list cut only where the
next `id:name:role:` starts (`config/keys.py`), so a key may hold both; a bad entry is named by
its position, never shown; `$TRIO_PD_API_KEY` and `$TRIO_PD_DATA_PLANE_API_KEYS` get the
visible-ASCII check `--api-key` gets (a CR/LF key once started and then failed every request).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.conftest import start_cluster
from tests.ops.serve import free_port
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import parse_keys

SECRET = "Zq7-secret-9Xw"


def config_of(*argv: str):  # type: ignore[no-untyped-def]
    return router_config(build_parser().parse_args(["serve", *argv]))


def test_a_key_may_hold_commas_and_semicolons() -> None:
    keys = parse_keys([f"k1:ops:admin:{SECRET},a;b", "k2:dash:user:x;y,z"])
    assert [(k.id, k.role, k.key) for k in keys] == [
        ("k1", "admin", f"{SECRET},a;b"), ("k2", "user", "x;y,z"),
    ]  # fmt: skip
    # A list in one argument (one environment variable) still splits where an entry starts.
    listed = parse_keys(["k1:ops:admin:a,b,k2:ci:user:c;k3:Service Account:ADMIN:d:e"])
    assert [(k.id, k.name, k.role, k.key) for k in listed] == [
        ("k1", "ops", "admin", "a,b"), ("k2", "ci", "user", "c"),
        ("k3", "Service Account", "admin", "d:e"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "entry",
    [
        SECRET,  # a bare key: once "got Zq7-secret-9Xw:..."
        f"{SECRET},k2:ci:user:x",  # a `,` before a good entry
        f"k1:ops:root:{SECRET}",
        f"{SECRET}:ops:admin",
        f"k1:ops:admin:{SECRET} tail",
        f"k1:ops:admin:{SECRET}\r\nx",
    ],
)
def test_a_bad_entry_never_shows_its_secret(entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_of("--control-plane-api-keys", entry)
    err = capsys.readouterr().err
    assert "--control-plane-api-keys: entry 1" in err
    assert "Zq7" not in err and "secret" not in err


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("TRIO_PD_API_KEY", f"{SECRET}\n", "$TRIO_PD_API_KEY must be visible ASCII"),
        ("TRIO_PD_API_KEY", f"{SECRET}\r\nx-injected: 1", "$TRIO_PD_API_KEY must be visible"),
        ("TRIO_PD_DATA_PLANE_API_KEYS", f"ok,{SECRET} x", "DATA_PLANE_API_KEYS: key 2 must be"),
    ],
)
async def test_keys_from_the_environment_are_checked_at_start(
    tmp_path: Path, variable: str, value: str, words: str
) -> None:
    """A real `trio-pd serve`: it refuses to start, saying which variable, not the key."""
    command = [
        sys.executable, "-m", "trio_pd", "serve", "--host", "127.0.0.1",
        "--port", str(free_port()), "--prometheus-port", str(free_port()),
        "--admin-port", str(free_port()), "--decode", "http://127.0.0.1:9",
        "--prefill", "http://127.0.0.1:8", "none",
    ]  # fmt: skip
    env = {**os.environ, variable: value}
    with trio.fail_after(30):
        done = await trio.run_process(
            command, env=env, check=False, capture_stdout=True, stderr=subprocess.STDOUT
        )
    out = done.stdout.decode()
    assert done.returncode == 2, out
    assert words in out and "Zq7" not in out and "routing on" not in out


async def test_a_key_with_commas_works_end_to_end(nursery: trio.Nursery) -> None:
    keys = config_of("--control-plane-api-keys", f"k1:ops:admin:{SECRET},;x").control_plane_api_keys
    cluster = await start_cluster(nursery, control_plane_api_keys=keys)
    for client in (cluster.client, cluster.admin):
        assert (await client.post("/flush_cache", headers={"x-api-key": SECRET})).status_code == 401
        ok = await client.post("/flush_cache", headers={"x-api-key": f"{SECRET},;x"})
        assert ok.status_code == 200, ok.text
    await cluster.client.aclose()
    await cluster.admin.aclose()
