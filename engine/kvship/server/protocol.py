"""Request bodies of the OpenAI API (the subset we serve), as pydantic models.

Unknown fields are ignored (clients send vendor extensions freely); wrong types become a 400
through `errors.validation_error`. Responses are plain dicts built in chat.py/completions.py in
OpenAI's exact shapes (streaming builds thousands of chunks a second; dicts keep that cheap).
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool

_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
    """JSON's `\\ud800` escapes decode to lone UTF-16 surrogates, which are not Unicode text: the
    tokenizer (and UTF-8) cannot take them, so they are refused where they enter."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise ValueError(f"the text contains a lone UTF-16 surrogate (\\u{ord(m.group()):04x}) at position "
                         f"{m.start()}, which is not valid Unicode")
    return text


# Text that reaches the tokenizer.
Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Request(BaseModel):
    # NaN / Infinity (which Python's JSON decoder accepts) are no sampling setting; booleans are
    # JSON's true/false only ("yes", "0" or 1 would be a guess at what the client meant).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---------------------------------------------------------------- requests


class StreamOptions(_Request):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # accepted, not used


class TextContentPart(_Request):
    type: Literal["text"] = "text"
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, object] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    json_: dict[str, object] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[Text] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: str | None = None


class _SamplingFields(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: StrictBool | None = False
    skip_special_tokens: StrictBool | None = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[int, float] | None = None  # token id (a JSON key: "50256") -> bias in [-100, 100]
    # Grammar-constrained output (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs object, and vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, object] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool | None = True
    # Declared so that they are refused with a 400 that names them (params.refuse_unsupported),
    # not ignored as unknown fields: a client asking for tool calls or JSON output must not get
    # free text back as if it had been honoured.
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[str, object]] | None = None
    function_call: str | dict[str, object] | None = None


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: int | None = None  # refused unless it equals n (params.refuse_unsupported)


class EmbeddingRequest(_Request):
    model: str | None = None
    # A string, a list of strings, a list of token ids, or a list of token-id lists (as /v1/completions).
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # a Matryoshka model's shorter vectors
    user: str | None = None
