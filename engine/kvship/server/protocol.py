"""Request bodies of the OpenAI API (the subset we serve), as pydantic models.

Unknown fields are ignored (clients send vendor extensions freely); wrong types become a 400
through `errors.validation_error`. Responses are plain dicts built in chat.py/completions.py in
OpenAI's exact shapes (streaming builds thousands of chunks a second; dicts keep that cheap).
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

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


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


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


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: Text | None = None  # an assistant's earlier thinking (kept out of templates that drop it)

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: object, info: ValidationInfo) -> object:
        # As in OpenAI's API, only an assistant's message may go without content (tool_calls
        # instead); a user turn of null was rendered as an empty one.
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message must have content")
        return content

    def template_dict(self) -> dict[str, object]:
        """The message as chat templates read it: tool-call arguments as objects (what HF
        templates expect; text that is not JSON stays text)."""
        d: dict[str, object] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d

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
    continue_final_message: StrictBool | None = False  # as on /v1/chat/completions


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


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON schema (None: no arguments)
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool | None = True
    # vLLM's: the final message is left open for the model to continue (no generation prompt).
    continue_final_message: StrictBool | None = False
    # Tool calling (server/tools.py)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Declared so that they are refused with a 400 that names them (params.refuse_unsupported),
    # not ignored as unknown fields: the legacy function-calling fields.
    functions: list[dict[str, object]] | None = None
    function_call: str | dict[str, object] | None = None
    # Passed to the chat template (e.g. {"enable_thinking": false} for Qwen3), as vLLM does.
    chat_template_kwargs: dict[str, object] | None = None
    # OpenAI's: passed to the chat template as `reasoning_effort` (gpt-oss's harmony template reads it)
    reasoning_effort: Literal["low", "medium", "high"] | None = None


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


# ---------------------------------------------------------------- /v1/responses


class ResponseContentPart(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class ResponseMessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ResponseContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class ResponseFunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: Text


class ResponseFunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: StrictBool | None = None


class ResponseNamedToolChoice(_Request):
    type: Literal["function"]
    name: str


class ResponseTextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseTextConfig(_Request):
    format: ResponseTextFormat | None = None


class ResponseReasoning(_Request):
    # effort goes to the chat template as chat's reasoning_effort; summaries are not written
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary


class ResponsesRequest(_Request):
    """OpenAI's Responses API (the subset kvship serves: text in and out, function tools,
    structured output, previous_response_id)."""

    model: str | None = None
    input: Text | list[ResponseFunctionCallItem | ResponseFunctionCallOutputItem | ResponseMessageItem]
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponseTextConfig | None = None
    reasoning: ResponseReasoning | None = None
    stream: StrictBool | None = False
    previous_response_id: str | None = None
    store: StrictBool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None
