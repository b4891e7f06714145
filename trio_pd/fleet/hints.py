"""What a selection policy may know of a request: a few routing facts, never the request.

Built once per request (dispatch) and handed to every selection of it, retries included, so a
policy reads plain fields and nothing is parsed or scanned on its behalf unless configured.
"""

from __future__ import annotations

import attrs


class RidKey(str):
    """A routing key read from the body's `rid` lineage (the sticky override without a header
    key), not from a header: most rids are one request's own, and `sticky.py` pins such a key
    only once it is seen again (issue 26 N14). Otherwise the same string as any key."""

    __slots__ = ()


@attrs.define(eq=False)
class KvProbe:
    """kv_aware: the prompt as the engine will see it, tokenized and hashed before selection
    (off the event loop, `fleet/kv_aware.py`), and what the policy predicted for the prefill it
    chose (the self-check compares it with the engine's report)."""

    tokens: int  # the prompt's tokens, by the router's tokenizer
    hashes: dict[int, list[int]]  # block size -> the prompt's block hashes at that size
    started: float  # when it was routed
    quiet: bool = True  # no other prefill of this router ran on the chosen worker when chosen
    predicted: dict[str, int] = attrs.Factory(dict)  # worker id -> cached tokens predicted


@attrs.frozen
class RouteHints:
    """`text`: the routing text (the prompt or conversation, capped) cache-aware matches on.
    `length`: the prompt's length in characters, uncapped (bucket); 0 without text (token ids).
    `key`: the client's routing key (manual, consistent_hashing, prefix_hash, the sticky
    override: `edge/routing_key.py`), a `RidKey` when read from the `rid` lineage; None when it
    sent none or no policy reads it.
    `model`: the model whose workers are the candidates; None when the router serves one.
    `affinity`: the client's `x-forwarded-for`, else its `cookie` (bounded as keys are): the key
    consistent_hashing hashes when there is no routing key; None unless that policy is used.
    `kv`: the prompt's tokens and block hashes, when the prefill policy is kv_aware."""

    text: str | None = None
    length: int = 0
    key: str | None = None
    model: str | None = None
    affinity: str | None = None
    kv: KvProbe | None = None  # kv_aware only: the prompt's block hashes


NO_HINTS = RouteHints()
