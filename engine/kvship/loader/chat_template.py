"""Rendering of Jinja chat templates, in a sandbox, with the helpers HF templates expect:
`raise_exception`, `strftime_now`, the `tojson` filter (non-ASCII kept, optional indent),
loop controls, and the `{% generation %}` block (rendered as plain content)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or refused the messages."""


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    for serving it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not compile (line {e.lineno}: {e.message})") from None


def render_chat_template(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                         special_tokens: dict[str, str | None] | None = None, **kwargs: Any) -> str:
    if not template:
        raise ChatTemplateError(
            "this model has no chat template; use the completions endpoint with a plain prompt, "
            "or pass a chat template for the model.")
    if not isinstance(messages, list):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
    tmpl = _compile(template)
    context: dict[str, Any] = dict(special_tokens or {})
    context.update({k: v for k, v in kwargs.items() if v is not None or k not in context})
    context["messages"] = messages
    context["add_generation_prompt"] = add_generation_prompt
    try:
        return tmpl.render(**context)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"rendering the chat template failed: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"rendering the chat template failed: {type(e).__name__}: {e}") from None
