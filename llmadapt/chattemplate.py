"""A model folder's chat template, and conversations rendered with it as text pieces that are trained on or not
(data.format 'sharegpt').

The template is read from the folder (``chat_template.jinja``, or ``tokenizer_config.json``'s ``chat_template``)
and rendered here with jinja2 the way transformers' ``apply_chat_template`` renders it (a sandboxed environment
with trim_blocks and lstrip_blocks, the loop controls, ``raise_exception`` and the ``tojson`` filter, the
tokenizer's special tokens as variables), so the orchestrator (no transformers) and every stack's workers (any
transformers version) get the same text, and so the same tokens.

A conversation is cut where each assistant turn starts and ends: the rendering of the turns before an answer with
the generation prompt is the text before it (masked), the answer's text up to and including the end-of-sequence
token is trained on, and whatever the template writes after that token (a newline) is masked again. jinja2 is
imported on first use (torch's environments have it; the core's install may not).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterator, NamedTuple

from llmadapt.modelfolder import CHAT_TEMPLATE_FILE as TEMPLATE_FILE
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplate(NamedTuple):
    template: str
    special: dict[str, str]
    """The tokenizer's special tokens as text (bos_token, eos_token, ...), the variables templates use."""

    @property
    def eos(self) -> str | None:
        return self.special.get("eos_token")


def read_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template a model folder ships, with its special tokens; None where it has none."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    template = None
    if (folder / TEMPLATE_FILE).is_file():
        template = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # named templates: the default one
        template = next((t.get("template") for t in config["chat_template"]
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    if not template:
        return None
    special = {}
    for name in _SPECIAL:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    return ChatTemplate(template, special)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("rendering the model's chat template needs jinja2 (pip install jinja2)") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"the model's chat template cannot be read by jinja2: {exc}") from None


def render(chat: ChatTemplate, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The template's text for MESSAGES (role, content), as apply_chat_template(tokenize=False) gives it."""
    return _compiled(chat.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **chat.special)


def messages_of(pairs: list[tuple[str, str]]) -> list[dict[str, str]]:
    """ShareGPT's (human, gpt) exchanges as chat messages."""
    return [m for human, gpt in pairs for m in ({"role": "user", "content": human},
                                               {"role": "assistant", "content": gpt})]


def pieces(chat: ChatTemplate, pairs: list[tuple[str, str]]) -> Iterator[tuple[str, bool]]:
    """The conversation's rendering, exchange by exchange, as (text, trained) pieces whose concatenation is the
    whole conversation's rendering: the template's text and the user's turns not trained, each answer up to and
    including the end-of-sequence token trained. Lazy: a caller that has enough tokens stops asking."""
    messages = messages_of(pairs)
    done = ""
    for k in range(1, len(messages), 2):
        before = render(chat, messages[:k], add_generation_prompt=True)
        after = render(chat, messages[:k + 1])
        if not before.startswith(done) or not after.startswith(before):
            raise ValueError("the model's chat template does not render a conversation as its earlier turns "
                             "followed by the next one: answer tokens cannot be told from the rest")
        answer = after[len(before):]
        content_at = answer.find(messages[k]["content"])
        after_content = content_at + len(messages[k]["content"]) if content_at >= 0 else 0
        end = answer.find(chat.eos, after_content) if chat.eos else -1
        cut = end + len(chat.eos) if end >= 0 else len(answer)
        yield before[len(done):], False
        yield answer[:cut], True
        if answer[cut:]:
            yield answer[cut:], False
        done = after
