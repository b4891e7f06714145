"""The etcd v3 JSON gateway client: the few calls membership needs, with endpoint failover."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import Any

import httpx2
import orjson

from trio_pd.membership.etcd.errors import EtcdCompacted, EtcdError, EtcdUnavailable, LeaseNotFound
from trio_pd.membership.etcd.wire import KeyValue, WatchEvent, b64, header_revision


class EtcdClient:
    """The few etcd v3 calls membership needs, as JSON over HTTP, with endpoint failover.

    A call goes to the endpoint that answered last; when that one cannot be reached it tries the
    next ones in turn. A request that may have reached etcd (the connection broke after it was
    sent, or etcd answered 5xx) is retried elsewhere only when it is safe to repeat (reads,
    keepalives); a write raises `EtcdUnavailable` instead, since it may have been applied.
    """

    def __init__(
        self,
        endpoints: Iterable[str],
        *,
        dial_timeout_secs: float = 2.0,
        request_timeout_secs: float = 5.0,
    ) -> None:
        self.endpoints = tuple(e.rstrip("/") for e in endpoints)
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self._current = 0
        self._timeout = httpx2.Timeout(request_timeout_secs, connect=dial_timeout_secs)
        self._watch_timeout = httpx2.Timeout(
            request_timeout_secs, connect=dial_timeout_secs, read=None
        )
        self._http = httpx2.AsyncClient(timeout=self._timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._current + i) % n for i in range(n)]

    async def call(self, path: str, body: Mapping[str, Any], *, idempotent: bool) -> dict:
        """POST ``body`` to ``path`` (e.g. ``/v3/kv/range``); the decoded JSON answer."""
        failures: list[str] = []
        for index in self._order():
            endpoint = self.endpoints[index]
            try:
                response = await self._http.post(f"{endpoint}{path}", json=body)
            except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
                failures.append(f"{endpoint}: {exc!r}")
                continue
            except httpx2.TransportError as exc:
                failures.append(f"{endpoint}: {exc!r}")
                if idempotent:
                    continue
                raise EtcdUnavailable(
                    f"{path} failed after sending: {'; '.join(failures)}"
                ) from exc
            if response.status_code >= 500 and idempotent:
                failures.append(f"{endpoint}: HTTP {response.status_code} {response.text[:200]}")
                continue
            self._current = index
            return decode_answer(path, response)
        raise EtcdUnavailable(f"no etcd endpoint answered {path}: {'; '.join(failures)}")

    async def range(
        self, key: bytes, range_end: bytes | None = None, *, revision: int = 0
    ) -> tuple[int, list[KeyValue]]:
        """(the store's revision, the keys in [key, range_end)) as of ``revision`` (0: now)."""
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if revision:
            body["revision"] = str(revision)
        answer = await self.call("/v3/kv/range", body, idempotent=True)
        return header_revision(answer), [KeyValue.from_json(kv) for kv in answer.get("kvs", ())]

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return header_revision(await self.call("/v3/kv/put", body, idempotent=True))

    async def delete_range(self, key: bytes, range_end: bytes | None = None) -> tuple[int, int]:
        """(revision, how many keys were deleted)."""
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        answer = await self.call("/v3/kv/deleterange", body, idempotent=True)
        return header_revision(answer), int(answer.get("deleted", 0))

    async def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: Iterable[dict[str, Any]] = (),
    ) -> dict:
        """One transaction; build its parts with `cmp_*` and `op_*`. Not retried once sent."""
        body = {"compare": compare, "success": success, "failure": list(failure)}
        answer = await self.call("/v3/kv/txn", body, idempotent=False)
        answer["succeeded"] = bool(answer.get("succeeded", False))
        return answer

    async def compact(self, revision: int) -> None:
        await self.call("/v3/kv/compaction", {"revision": str(revision)}, idempotent=True)

    async def lease_grant(self, ttl_secs: int) -> tuple[int, int]:
        """(lease id, granted TTL)."""
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl_secs)}, idempotent=False)
        if answer.get("error"):
            raise EtcdError(f"lease grant refused: {answer['error']}")
        return int(answer["ID"]), int(answer.get("TTL", ttl_secs))

    async def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease`` once; its new TTL, 0 when the lease no longer exists."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, idempotent=True)
        return int(answer.get("result", answer).get("TTL", 0))

    async def lease_time_to_live(self, lease: int) -> int:
        """Seconds ``lease`` has left; -1 when it no longer exists."""
        answer = await self.call("/v3/lease/timetolive", {"ID": str(lease)}, idempotent=True)
        return int(answer.get("TTL", -1))

    async def lease_revoke(self, lease: int) -> None:
        """Revoke ``lease`` (its keys are deleted); a lease already gone is not an error."""
        with suppress(LeaseNotFound):
            await self.call("/v3/lease/revoke", {"ID": str(lease)}, idempotent=True)

    @asynccontextmanager
    async def watch(
        self, key: bytes, range_end: bytes | None, *, start_revision: int
    ) -> AsyncIterator[AsyncIterator[list[WatchEvent]]]:
        """A watch of [key, range_end) from ``start_revision``: yields an iterator of event
        batches (one per revision or more). Raises `EtcdCompacted` when that revision is gone,
        `EtcdUnavailable` when the stream cannot be opened or breaks."""
        create: dict[str, Any] = {"key": b64(key), "start_revision": str(start_revision)}
        if range_end is not None:
            create["range_end"] = b64(range_end)
        body = {"create_request": create}
        failures: list[str] = []
        for index in self._order():
            endpoint = self.endpoints[index]
            async with AsyncExitStack() as stack:
                try:
                    response = await stack.enter_async_context(
                        self._http.stream(
                            "POST", f"{endpoint}/v3/watch", json=body, timeout=self._watch_timeout
                        )
                    )
                except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
                    failures.append(f"{endpoint}: {exc!r}")
                    continue
                except httpx2.TransportError as exc:
                    raise EtcdUnavailable(f"watch on {endpoint} failed: {exc!r}") from exc
                if response.status_code != 200:
                    await response.aread()
                    try:
                        decode_answer("/v3/watch", response)  # raises for any non-200
                    except EtcdUnavailable as exc:
                        failures.append(f"{endpoint}: {exc}")
                        continue
                self._current = index
                try:
                    yield watch_batches(response)
                except httpx2.TransportError as exc:
                    raise EtcdUnavailable(f"watch on {endpoint} broke: {exc!r}") from exc
                return
        raise EtcdUnavailable(f"no etcd endpoint accepted a watch: {'; '.join(failures)}")


async def watch_batches(response: httpx2.Response) -> AsyncIterator[list[WatchEvent]]:
    """The gateway's watch stream (one JSON object a line) as batches of events."""
    async for line in response.aiter_lines():
        if not line.strip():
            continue
        try:
            message = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise EtcdError(f"watch stream sent a line that is not JSON: {line[:200]!r}") from exc
        if "error" in message:
            error = message["error"]
            detail = error.get("message", error) if isinstance(error, dict) else error
            raise EtcdUnavailable(f"watch stream error: {detail}")
        result = message.get("result", {})
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                raise EtcdCompacted(f"watch revision compacted (oldest {compacted})", compacted)
            raise EtcdError(f"watch canceled: {result.get('cancel_reason', 'no reason given')}")
        events = [
            WatchEvent(e.get("type", "PUT"), KeyValue.from_json(e.get("kv", {})))
            for e in result.get("events", ())
        ]
        if events:
            yield events
    raise EtcdUnavailable("watch stream ended")


def decode_answer(path: str, response: httpx2.Response) -> dict:
    try:
        answer = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        answer = None
    if response.status_code == 200 and isinstance(answer, dict):
        return answer
    message = answer.get("message") or answer.get("error") if isinstance(answer, dict) else None
    message = str(message or response.text[:200] or f"HTTP {response.status_code}")
    code = answer.get("code") if isinstance(answer, dict) else None
    if "lease not found" in message:
        raise LeaseNotFound(message, code)
    if code == 11 and "compacted" in message:
        raise EtcdCompacted(message, 0)
    if response.status_code >= 500 or code == 14:  # 14: UNAVAILABLE
        raise EtcdUnavailable(f"{path}: {message}", code)
    raise EtcdError(f"{path}: {message}", code)
