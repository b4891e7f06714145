"""A prompt's KV block hashes, computed exactly as SGLang 0.5.23 names the blocks it publishes.

Read from its source (`srt/mem_cache/cpp_utils/hash_binding.cpp` `hash_pages_to_hex_blob`,
`srt/mem_cache/utils.py` `compute_node_hash_values` and `hash_str_to_int64`,
`srt/mem_cache/events.py` `KVCacheEventRecorder.record_store`): page i of the token ids (the
ids as little-endian uint32, `block_size` of them) is hashed with SHA-256 over the previous
page's 32-byte digest followed by its bytes (the first page has no prefix); the published
hash is the digest's first 8 bytes read as a big-endian signed int64. Only full pages count:
the radix cache stores a prompt page-aligned. Requests with a LoRA adapter or a `cache_salt`
are namespaced by the engine (`namespaced_block_hash`); the router does not hash those.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

MAX_TOKEN_ID = 2**32 - 1  # wider ids take another encoding in the engine: not hashed here


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    max_blocks: int,
    held: Callable[[int], bool] | None = None,
) -> list[int]:
    """The hashes of the first full pages of `token_ids`, at most `max_blocks` of them, and
    with `held`, only up to the first block nobody holds: a match stops there, and a SHA-256
    a page (held under the GIL for inputs this small) is the router's biggest cost."""
    if block_size <= 0:
        return []
    pages = min(len(token_ids) // block_size, max_blocks)
    pack = struct.Struct(f"<{block_size}I").pack
    sha256 = hashlib.sha256
    out: list[int] = []
    prior = b""
    for page in range(pages):
        ids = token_ids[page * block_size : (page + 1) * block_size]
        try:
            data = pack(*ids)
        except struct.error:  # an id outside uint32: the engine hashes it otherwise
            break
        prior = sha256(prior + data).digest()
        value = int.from_bytes(prior[:8], "big", signed=True)
        out.append(value)
        if held is not None and not held(value):
            break
    return out


def cacheable_tokens(prompt_tokens: int, block_size: int) -> int:
    """The most tokens an engine can report reused for a prompt of this length: SGLang matches
    at most `len - 1` tokens (one is always computed), page-aligned."""
    if block_size <= 0 or prompt_tokens <= 1:
        return 0
    return (prompt_tokens - 1) // block_size * block_size
