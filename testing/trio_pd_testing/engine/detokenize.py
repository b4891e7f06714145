"""The simulator's token bytes and SGLang 0.5.23's incremental detokenizer (`multibyte_tokens`).

SGLang's model tokenizers are byte-level: a token is bytes, and a character of several UTF-8
bytes may be split over tokens. The detokenizer (`managers/detokenizer_manager.py`
`_decode_batch_token_id_output`) decodes each request's ids since its last commit behind a
window of context (at first the prompt's last 5 ids, `schedule_batch.py`
`INIT_INCREMENTAL_DETOKENIZATION_OFFSET`): text that ends in "�" (a character whose bytes have
not all arrived) is not committed, and only its printable prefix goes out
(`sglang.utils.find_printable_text`: up to the last space or newline); the rest follows once the
character is whole. A resumed request whose prompt ends inside a character (a router's
migration that cut there) is decoded behind that prompt: the character's first bytes are in
the window, so its text is never sent. `Detokenizer` is that logic, step by step.

The vocabulary (`token_bytes`): a generated token `tok<k>` (id `workload.output_id(k)`) is
`b" tok<k>"` (`b"tok1"` first). With `multibyte_tokens` some are partial characters, in a
cycle of 6: `tok<6m+2>` ends with a space and the first byte of "ب" (U+0628, D8 A8), the
next token starts with the second; `tok<6m+4>` ends with the first byte of "€" (U+20AC,
E2 82 AC), `tok<6m+5>` is its second byte alone, `tok<6m+6>` starts with the third. Any other
id (a prompt's words) is `b" w<id>"`. POST /detokenize decodes ids with these bytes, invalid or
cut UTF-8 as "�" (the fast tokenizer's lossy decoding).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from trio_pd_testing.engine.workload import output_id

INIT_OFFSET = 5  # schedule_batch.INIT_INCREMENTAL_DETOKENIZATION_OFFSET
REPLACEMENT = "\ufffd"


def output_bytes(k: int, multibyte: bool) -> bytes:
    """The bytes of the k-th (1-based) generated token `tok<k>`."""
    word = b"tok%d" % k if k == 1 else b" tok%d" % k
    if not multibyte:
        return word
    phase = k % 6
    if phase == 2:
        return word + b" \xd8"  # ب's first byte, after a space: a printable prefix goes out
    if phase == 3:
        return b"\xa8" + word  # ب whole
    if phase == 4:
        return word + b"\xe2"  # €'s first byte, no space: nothing printable after " tok"
    if phase == 5:
        return b"\x82"  # €'s second byte alone
    if phase == 0:
        return b"\xac" + word  # € whole
    return word


def token_bytes(token_id: int, multibyte: bool) -> bytes:
    k = token_id - output_id(0)
    if k >= 1:
        return output_bytes(k, multibyte)
    return b" w%d" % token_id


def decode(ids: Iterable[int], multibyte: bool) -> str:
    """The text of `ids` (cut or invalid UTF-8 as "�", as a byte-level fast tokenizer)."""
    return b"".join(token_bytes(i, multibyte) for i in ids).decode("utf-8", "replace")


def find_printable_text(text: str) -> str:
    """`sglang.utils.find_printable_text` (its CJK rules aside: the vocabulary has no CJK)."""
    if text.endswith("\n"):
        return text
    return text[: text.rfind(" ") + 1]


@attrs.define
class Detokenizer:
    """One request's DecodeStatus: what its next step sends (`step`)."""

    multibyte: bool
    ids: list[int]  # the window's context (the prompt's last ids) and the output ids
    surr: int = 0
    read: int = 0
    decoded: str = ""  # committed text
    sent: int = 0  # characters sent: committed plus a printable prefix of the uncommitted

    @classmethod
    def of(cls, prompt: Iterable[int], multibyte: bool) -> Detokenizer:
        tail = list(prompt)[-INIT_OFFSET:]
        return cls(multibyte, tail, 0, len(tail))

    def step(self, new_ids: Iterable[int], finished: bool) -> str:
        """The text this step sends for `new_ids` (the request's last step if `finished`)."""
        self.ids.extend(new_ids)
        surr_text = decode(self.ids[self.surr : self.read], self.multibyte)
        new_text = decode(self.ids[self.surr :], self.multibyte)[len(surr_text) :]
        if finished:
            whole = self.decoded + new_text
            out, self.sent = whole[self.sent :], len(whole)
            return out
        pending = self.sent - len(self.decoded)
        if new_text and not new_text.endswith(REPLACEMENT):
            self.decoded += new_text
            self.surr, self.read = self.read, len(self.ids)
            self.sent = len(self.decoded)
            return new_text[pending:]
        printable = find_printable_text(new_text)
        self.sent = len(self.decoded) + len(printable)
        return printable[pending:]
