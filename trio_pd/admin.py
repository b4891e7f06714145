"""Admin and fan-out routes: worker membership, loads, model info (placeholder until built)."""

from __future__ import annotations

from trio_pd.asgi import Handler

ADMIN_ROUTES: dict[str, dict[str, Handler]] = {}
WORKER_ITEM_ROUTES: dict[str, Handler] = {}
