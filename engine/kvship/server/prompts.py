"""Request -> prompt token ids: the chat template over messages, or a completion's prompt(s)
as text or token ids. Long inputs are tokenised in a worker thread, off the event loop."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVar

from kvship.loader.tokenizer import Tokenizer
from kvship.server.errors import bad_request
from kvship.server.protocol import ChatMessage
from kvship.server.tool_prompt import template_shows_tools, with_tool_prompt

T = TypeVar("T")

# Tokenizing a long prompt takes milliseconds; above this many characters it runs in a worker
# thread so that the event loop keeps streaming other requests' tokens meanwhile.
OFFLOAD_CHARS = 8192


async def run_tokenizer(fn: Callable[..., T], *args: object, size: int) -> T:
    if size > OFFLOAD_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


# A normalizer may shorten a text before it is split into tokens (NFKC folds some sequences;
# some normalizers strip whitespace): the bound on tokens from characters allows for that.
NORMALIZER_SLACK = 4


def check_text_fits(tokenizer: Tokenizer, chars: int, max_model_len: int, param: str) -> None:
    """Refuse, without tokenising it, a text whose length alone proves that it has more tokens
    than the context holds: tokenising megabytes only to find that out takes seconds."""
    at_least = chars // (tokenizer.max_token_chars * NORMALIZER_SLACK)
    if at_least >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has at "
            f"least {at_least} tokens ({chars} characters), leaving no room for the completion. Please reduce "
            "the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"Token id {t} is out of range [0, {vocab_size}).", param=param)


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict[str, object] | None = None) -> str | list[int]:
    """The chat template rendered over `messages`; `template_kwargs` (tools, chat_template_kwargs
    such as enable_thinking) reach the template's context. A template that cannot show tools
    gets kvship's tool prompt and earlier calls and results as text instead (server/tool_prompt)."""
    plain = [m.template_dict() for m in messages]
    kwargs = dict(template_kwargs or {})
    if not template_shows_tools(tokenizer):
        tools = kwargs.pop("tools", None)
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in plain):
            plain = with_tool_prompt(plain, tools)
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError as exc:  # ChatTemplateError included
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from None


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: dict[str, object] | None = None, continue_final: bool = False) -> list[int]:
    """Token ids of the chat template rendered over `messages` (render_chat)."""
    rendered = render_chat(tokenizer, messages, add_generation_prompt, template_kwargs)
    if continue_final and isinstance(rendered, str):
        rendered = _continued(rendered, messages)
    if isinstance(rendered, str):
        # The template already carries the special tokens (BOS etc.).
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(rendered)


class _PromptFlags(Protocol):
    add_generation_prompt: bool | None
    continue_final_message: bool | None
    model_fields_set: set[str]


def generation_prompt(body: _PromptFlags) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat or tokenize request. As in vLLM,
    the final message is continued (no generation prompt: the model goes on writing it) when
    continue_final_message is set; asking for a generation prompt too is a 400."""
    if not body.continue_final_message:
        return body.add_generation_prompt is not False, False
    if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: the first "
                          "continues the final message, the second starts a new assistant message.",
                          param="continue_final_message")
    return False, True


def _continued(rendered: str, messages: list[ChatMessage]) -> str:
    """`rendered` cut right after the final message's text (what transformers does for
    continue_final_message); the text stripped too, for templates that trim messages."""
    final = messages[-1].text() if messages else ""
    for text in (final, final.strip()):
        at = rendered.rfind(text) if text else -1
        if at >= 0:
            return rendered[:at + len(text)]
    raise bad_request("continue_final_message needs a final message with text that the chat template renders "
                      "unchanged.", param="messages")


def chat_size(messages: list[ChatMessage]) -> int:
    return sum(len(m.text()) for m in messages)


CompletionPrompt = str | list[str] | list[int] | list[list[int]]


def check_prompt_count(prompt: CompletionPrompt, limit: int, param: str = "prompt") -> int:
    """How many prompts a completion (or embedding) request carries (a 400 past `limit`),
    counted before anything is tokenised."""
    count = 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)
    if count > limit:
        raise bad_request(f"A request may carry at most {limit} prompts, got {count}. Split it, or raise the "
                          "server's --max-prompts-per-request.", param=param)
    return count


def completion_prompts(tokenizer: Tokenizer, prompt: CompletionPrompt, param: str = "prompt"
                       ) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of each prompt, and its text when it came as text (for echo)."""
    items: list = [prompt] if isinstance(prompt, str) else list(prompt)
    if not items:
        raise bad_request(f"{param} must not be empty.", param=param)
    if isinstance(items[0], int):
        items = [items]
    ids: list[list[int]] = []
    texts: list[str | None] = []
    for p in items:
        if isinstance(p, str):
            ids.append(list(tokenizer.encode(p, add_special_tokens=True)))
            texts.append(p)
        else:
            check_token_ids(p, tokenizer.vocab_size, param)
            ids.append(list(p))
            texts.append(None)
        if not ids[-1]:
            raise bad_request(f"{param} must not be empty.", param=param)
    return ids, texts


def completion_size(prompt: CompletionPrompt) -> int:
    """Characters of text and token ids given: the work tokenising and checking the prompts costs."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)


def completion_texts(prompt: CompletionPrompt) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    return [p for p in prompt if isinstance(p, str)]
