"""Who may call what: the router's API key, control-plane keys with roles, the admin listener.

SGLang's router (SMG 0.3.2, `server.rs::build_app`) meanings, kept: `--api-key` is both the key
the router sends TO WORKERS (see `dispatch.leg_headers_for`) and, when set, the key clients must
present on the generation routes and, without control-plane keys, on the control plane; the
control plane is otherwise guarded by `--control-plane-api-keys 'id:name:role:key'` (role
`admin` may change, `user` may read), keys compared in constant time, with
`--control-plane-audit-enabled` logging who changed what.

A request comes through one of two doors: the data-plane port (`--host`:`--port`), or the
admin listener (`--admin-host`:`--admin-port`, loopback by default: `serve/doors.py`).
Routes by class:
- data plane (generation, `/v1/models`): open unless `--api-key` or `--data-plane-api-keys` (our
  addition: more client keys, e.g. one per team, rotated without touching the workers' key) is
  set: then one of those keys. Not served on the admin listener. Health, readiness and metrics
  stay open on both doors, as in SMG;
- control read (`GET /workers...`, `/get_loads`, `/health_generate`, `/get_model_info`,
  `/get_server_info`): a `user` or `admin` key when control-plane keys are configured, else the
  `--api-key` when set, else open (on both doors, as in SMG);
- control write (`POST /workers`, `DELETE /workers/{id}`, `POST /flush_cache`): an `admin` key;
  without control-plane keys, the `--api-key` (as SMG); without either, the admin listener
  only: the data-plane port refuses them (403 naming the flags, never the listener's address),
  whoever the TCP peer is. A local proxy or service-mesh sidecar in front of the data plane
  (nginx on the host, Istio's 127.0.0.6) therefore cannot pass a remote client's change
  through (a deliberate difference from SMG, whose control plane is then open: anyone who
  reaches the port could add a worker and receive users' prompts).
Keys, once configured, are required on both doors: the admin listener is no way around them.
The admin listener answers no browser: a request carrying `Origin` is refused (a web page the
operator opens could otherwise POST to a loopback port), and it sends no CORS headers.
A key is given as `Authorization: Bearer <key>` or `x-api-key: <key>`.
"""

from __future__ import annotations

import hmac
import logging
from typing import Literal

import attrs

from trio_pd.config import ControlKey
from trio_pd.errors import RouterError

log = logging.getLogger(__name__)
audit_log = logging.getLogger("trio_pd.audit")

AccessClass = Literal["open", "data", "read", "write"]
Door = Literal["data", "admin"]  # the data-plane port, or the admin listener


def unauthorized(message: str = "missing or invalid API key") -> RouterError:
    return RouterError(
        401,
        message,
        "authentication_error",
        headers=((b"www-authenticate", b'Bearer realm="trio_pd"'),),
    )


def forbidden(message: str) -> RouterError:
    return RouterError(403, message, "permission_error")


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries: `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value:
            return value.strip()
    return None


@attrs.frozen
class Caller:
    """Who made a control-plane call, for the audit log."""

    key_id: str
    name: str
    role: str


@attrs.frozen(eq=False)
class Access:
    """The router's access rules, built once from its config."""

    control_keys: tuple[ControlKey, ...] = ()
    data_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    audit: bool = False
    router_key: str | None = attrs.field(default=None, repr=False)  # --api-key
    # Where the admin listener answers, for the start-up log (None: this router has none).
    admin_url: str | None = None

    @property
    def keyless(self) -> bool:
        """No control-plane keys and no `--api-key`: changes only on the admin listener."""
        return not self.control_keys and not self.router_key

    @property
    def client_keys(self) -> tuple[str, ...]:
        """The keys a client may present on the data plane (none: the data plane is open)."""
        return self.data_keys + ((self.router_key,) if self.router_key else ())

    def check(
        self, access: AccessClass, headers: list[tuple[bytes, bytes]], door: Door = "data"
    ) -> Caller | None:
        """Raise 401/403 unless the request may use a route of class `access` through `door`."""
        if door == "admin" and any(name == b"origin" for name, _ in headers):
            raise forbidden("the admin listener does not answer browsers (the request has Origin)")
        if access == "open":
            return None
        if access == "data":
            keys = self.client_keys
            if keys and not _matches_any(presented_key(headers), keys):
                raise unauthorized()
            return None
        if self.keyless:
            if access == "read":
                return None
            if door == "admin":
                return ADMIN_LISTENER
            raise forbidden(self.no_keyless_writes())
        if not self.control_keys:
            if not _matches_any(presented_key(headers), (self.router_key or "",)):
                raise unauthorized()
            return Caller("api-key", "--api-key", "admin")
        given = presented_key(headers)
        for entry in self.control_keys:
            if given is not None and hmac.compare_digest(given, entry.key.encode()):
                if access == "write" and entry.role != "admin":
                    raise forbidden(f"key {entry.id} has role {entry.role}; this needs admin")
                return Caller(entry.id, entry.name, entry.role)
        raise unauthorized()

    def no_keyless_writes(self) -> str:
        """The data plane's 403 for a change without keys. It names the flags, never the admin
        listener's address nor whether there is one: anyone may reach the data port, and the
        operator who needs the address has it in the start-up log (issue 26, N14)."""
        return (
            "changes without keys are served on the admin listener only (--admin-host, "
            "--admin-port), never on this port; or configure --control-plane-api-keys "
            "(or --api-key) to make them here with a key"
        )

    def record(self, caller: Caller | None, method: str, path: str, status: int, what: str) -> None:
        """One audit line per control-plane change (never the key itself)."""
        if self.audit and caller is not None:
            audit_log.info(
                "audit key_id=%s name=%s role=%s %s %s -> %d %s",
                caller.key_id, caller.name, caller.role, method, path, status, what,
            )  # fmt: skip


def _matches_any(given: bytes | None, keys: tuple[str, ...]) -> bool:
    if given is None:
        return False
    found = False
    for key in keys:  # no early exit: the time taken does not say which key was close
        found |= hmac.compare_digest(given, key.encode())
    return found


ADMIN_LISTENER = Caller("-", "admin-listener", "admin")  # a keyless change, for the audit log


def startup_warnings(access: Access) -> None:
    if access.keyless:
        where = access.admin_url or "nowhere (no --admin-port)"
        log.warning(
            "no --control-plane-api-keys: worker membership and cache flushes are served on the "
            "admin listener only (%s); read-only control routes are open",
            where,
        )
