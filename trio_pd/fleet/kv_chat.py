"""A chat request's prompt as SGLang 0.5.23 renders it, for kv_aware: the model's chat template.

SGLang turns `/v1/chat/completions` into ids by its model directory's Jinja chat template
(`entrypoints/openai/serving_chat.py` `_apply_jinja_template`, `_render_and_encode_chat_template`;
the template chosen in `parser/template_manager.py`), rendered by HF transformers
(`utils/chat_template_utils.py` `render_jinja_template`, transformers 5.19 in the tier). What the
router repeats, read from that source:
- the template: `chat_template.jinja` in the model directory, else `tokenizer_config.json`'s
  `chat_template` (a string, or a list of named ones of which SGLang takes the first);
- the environment: jinja2's `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`
  with `loopcontrols`, HF's `tojson` (no HTML escaping), `raise_exception`, `strftime_now`, and a
  `{% generation %}` block that renders its body;
- the variables: `messages`, `tools=None`, `documents=None`, `add_generation_prompt=True`, the
  named special tokens (`bos_token`, `eos_token`, ... as strings), then the request's
  `reasoning_effort` and `chat_template_kwargs` (a `reasoning_effort` among them wins);
- the messages: each as SGLang's pydantic model dumps it less its None fields (a `user` message
  keeps only `role` and `content`; other roles, lowercased, keep `tool_call_id`, `name`, `phase`,
  `reasoning_content`, `prefix` when given), `content: null` as `""`, a list of text parts joined
  by spaces when the template reads content as a string, kept as parts when it loops over
  `message.content` (SGLang's `detect_jinja_template_content_format`), a tool message's parts
  always joined; a final assistant message becomes a user message with its text.
The rendered text is then encoded with special tokens only if `encode("")` is empty (a tokenizer
that adds them itself would double the BOS: SGLang's `_tokenizer_auto_adds_specials`).

What it does not render (`render` answers None, and the approximate tree routes the request):
tools (unless `tool_choice` is "none"), messages with `tool_calls` or `tools`, non-text content
parts (the media processor rewrites the prompt), `continue_final_message`, kwargs that are
`apply_chat_template`'s own parameters. An engine started with `--chat-template` or one of
SGLang's built-in conversation or Python templates renders otherwise: the self-check shows it.
jinja2 (what HF renders with) is imported only here, only with kv_aware and a chat template.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
# A generic message's fields after role and content, in SGLang's field order (protocol.py).
GENERIC_FIELDS = ("tool_call_id", "name", "phase", "reasoning_content", "prefix")
NOT_RENDERED_FIELDS = ("tool_calls", "tools")
SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip
# `apply_chat_template`'s own parameters: in chat_template_kwargs they fail or change the call.
RESERVED_KWARGS = frozenset((
    "chat_template", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation",
))  # fmt: skip


def load_template(model_dir: str) -> ChatTemplate | None:
    """The model directory's chat template as SGLang picks it, or None when it has none."""
    if not os.path.isdir(model_dir):
        return None
    source: str | None = None
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as handle:
            source = handle.read()
    else:
        value = config.get("chat_template")
        if isinstance(value, str):
            source = value
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            first = value[0].get("template")  # SGLang: "the first available template"
            source = first if isinstance(first, str) else None
    if source is None:
        return None
    specials = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    specials.update(config)  # the tokenizer's config wins, as HF loads it
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = specials.get(name)
        if isinstance(value, dict):  # an AddedToken: its text
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return ChatTemplate(source, tokens)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2  # only with kv_aware and a chat template (see docs/policies.md)
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(jinja2.ext.Extension):
            """HF's `{% generation %}` tag (assistant-token masks): renders its body."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                call = self.call_method("_body")
                return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

            def _body(self, caller: Any) -> Any:
                return caller()

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special_tokens = special_tokens
        self.content_format = _content_format(env, source)

    def render(self, payload: dict[str, Any]) -> str | None:
        """The prompt text SGLang renders for this chat body, or None (see the module)."""
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        if payload.get("tools") and payload.get("tool_choice") != "none":
            return None
        if payload.get("continue_final_message"):
            return None
        kwargs = payload.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or RESERVED_KWARGS.intersection(kwargs):
            return None
        kwargs = dict(kwargs)
        effort = kwargs.pop("reasoning_effort", None)
        if effort is None:
            effort = payload.get("reasoning_effort")
        extra: dict[str, Any] = {"reasoning_effort": effort} if effort is not None else {}
        extra.update(kwargs)
        rendered = []
        for message in messages:
            one = self._message(message)
            if one is None:
                return None
            rendered.append(one)
        last = rendered[-1]
        if last["role"] == "assistant" and isinstance(last.get("content"), str):
            rendered[-1] = {"role": "user", "content": last["content"]}
        variables = {**self.special_tokens, **extra}
        try:
            text: str = self.template.render(
                messages=rendered, tools=None, documents=None, add_generation_prompt=True,
                **variables,
            )  # fmt: skip
        except Exception:  # the template refuses it (raise_exception...): the engine will too
            return None
        return text

    def _message(self, message: Any) -> dict[str, Any] | None:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        if not isinstance(role, str):
            return None
        content = message.get("content")
        if role == "user":
            if content is None:
                return None
            out: dict[str, Any] = {"role": "user", "content": content}
        else:
            role = role.lower()
            if role not in GENERIC_ROLES or any(message.get(k) for k in NOT_RENDERED_FIELDS):
                return None
            out = {"role": role, "content": "" if content is None else content}
            for key in GENERIC_FIELDS:
                if message.get(key) is not None:
                    out[key] = message[key]
        if isinstance(out["content"], list):
            texts = []
            for part in out["content"]:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    return None  # media, thinking or tool_reference parts
                text = part.get("text")
                if not isinstance(text, str):
                    return None
                texts.append(text)
            if self.content_format == "string" or role == "tool":
                out["content"] = " ".join(texts)
            else:  # SGLang rebuilds the message with its content last
                del out["content"]
                out["content"] = [{"type": "text", "text": t} for t in texts]
        elif not isinstance(out["content"], str):
            return None
        return out


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _content_format(env: Any, source: str) -> str:
    """`openai` (content kept as parts) when the template loops over `message.content` (or
    `msg.content`, `m.content`) or names media at all, else `string`: SGLang's
    `detect_jinja_template_content_format` (parser/jinja_template_utils.py)."""
    import jinja2.nodes as nodes

    if any(word in source for word in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        tree = env.parse(source)
    except Exception:
        return "string"

    def reads(node: Any, name: str) -> bool:
        if isinstance(node, nodes.Filter | nodes.Test):
            return node.node is not None and reads(node.node, name)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            return reads(node.node, name)
        if isinstance(node, nodes.Getitem):
            return (
                _is_name(node.node, name)
                and isinstance(node.arg, nodes.Const)
                and node.arg.value == "content"
            )
        if isinstance(node, nodes.Getattr):
            return _is_name(node.node, name) and node.attr == "content"
        return False

    for loop in tree.find_all(nodes.For):
        if any(reads(loop.iter, name) for name in ("message", "msg", "m")):
            return "openai"
    return "string"


def _is_name(node: Any, name: str) -> bool:
    import jinja2.nodes as nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
