"""Request -> SamplingParams: the one place where a request's sampling fields get their
defaults and are checked, so that every refusal names the request's own `param`.

Two steps, because the prompt's length is known only once it is tokenised, and tokenising a
long prompt costs more than checking the fields: `sampling_params` checks every field before
any tokenising happens, `fit_to_context` then checks the prompts against the context window
and fills in an open `max_tokens`. The engine's own checks in `add_request` stay as a safety
net for other callers (the offline `LLM`), not as part of this path.
"""
from __future__ import annotations

import dataclasses

from kvship.core.grammar import check_tool_parameters
from kvship.sampling_params import MAX_LOGPROBS, InvalidParamsError, SamplingParams
from kvship.server.engine_client import EngineClient
from kvship.server.errors import APIError, bad_request
from kvship.server.prompts import check_token_ids
from kvship.server.protocol import ChatCompletionRequest, CompletionRequest
from kvship.server.structured import structured_output
from kvship.server.tools import ToolPlan

MAX_N = 128  # upper bound on `n` (also bounded by the engine's max_num_seqs)
MAX_TEMPERATURE = 2.0  # OpenAI's bound; past it sampling is noise, and 1e308 was accepted
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


def _opt(value: object, default: object) -> object:
    return default if value is None else value


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server.", param=param, code="unsupported_parameter")


def refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming the first field that asks for something not implemented. Values that ask for
    nothing (functions: [], function_call: "none", best_of == n) pass: clients send them as
    defaults."""
    if isinstance(body, ChatCompletionRequest):
        if body.functions:
            raise _unsupported("functions", "Function calling (`functions`)")
        if body.function_call not in (None, "none", "auto"):
            raise _unsupported("function_call", "Function calling (`function_call`)")
    elif body.best_of is not None and body.best_of != (body.n or 1):
        raise _unsupported("best_of", "`best_of` other than `n`")
    if isinstance(body, CompletionRequest) and body.suffix:
        raise _unsupported("suffix", "`suffix`")


def sampling_params(body: ChatCompletionRequest | CompletionRequest, engine: EngineClient) -> SamplingParams:
    """The request's SamplingParams, every field checked (a 400 naming the field otherwise).
    Fields the request leaves out get the model's recommended values (`engine.sampling_defaults`),
    then OpenAI's. `max_tokens` stays None where the request leaves it open: `fit_to_context`
    fills it in once the prompt's length is known."""
    refuse_unsupported(body)
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise bad_request("logprobs must be set to true when top_logprobs is used.", param="top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {body.top_logprobs}.",
                                  param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        prompt_logprobs = body.logprobs if body.echo else None  # echo scores the prompt's tokens too

    if body.temperature is not None and not 0 <= body.temperature <= MAX_TEMPERATURE:
        raise bad_request(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {body.temperature}.",
                          param="temperature", code="invalid_value")
    defaults = engine.sampling_defaults or {}
    n = _opt(body.n, 1)
    max_n = min(MAX_N, engine.config.max_num_seqs)
    if n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {n}.", param="n")
    check_token_ids(body.stop_token_ids or [], engine.tokenizer.vocab_size, "stop_token_ids")
    check_token_ids(list(body.logit_bias or {}), engine.tokenizer.vocab_size, "logit_bias")
    stop = body.stop
    if isinstance(stop, str):
        stop = [stop]
    try:
        return SamplingParams(
            n=n,
            temperature=_opt(body.temperature, defaults.get("temperature", 1.0)),
            top_p=_opt(body.top_p, defaults.get("top_p", 1.0)),
            top_k=_opt(body.top_k, defaults.get("top_k", -1)),
            min_p=_opt(body.min_p, defaults.get("min_p", 0.0)),
            presence_penalty=_opt(body.presence_penalty, 0.0),
            frequency_penalty=_opt(body.frequency_penalty, 0.0),
            repetition_penalty=_opt(body.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=_opt(body.min_tokens, 0),
            stop=list(stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=_opt(body.skip_special_tokens, True),
            logit_bias=dict(body.logit_bias or {}),
            structured=structured_output(body),
        )
    except InvalidParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def with_reasoning_markers(params: SamplingParams, reasoning_parser: str | None) -> SamplingParams:
    """harmony's channel and message markers are special tokens: kept in the text for its parser."""
    if reasoning_parser == "harmony":
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def with_tool_constraint(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """A required or named tool call is generated under its grammar (ToolPlan.constraint); it
    cannot be combined with another output constraint. Every tool's `parameters` must be an
    object schema (a 400 naming the tool otherwise). The mistral format's [TOOL_CALLS] marker and
    harmony's markers are special tokens: kept in the text for the parser."""
    if plan is None:
        return params
    for i, tool in enumerate(plan.tools):
        if tool.function.parameters is not None:
            try:
                check_tool_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
            except InvalidParamsError as exc:
                raise bad_request(str(exc), param=exc.param) from None
    if plan.parser in ("mistral", "harmony"):
        params = dataclasses.replace(params, skip_special_tokens=False)
    constraint = plan.constraint()
    if constraint is None:
        return params
    if params.structured is not None:
        raise bad_request(f"A {plan.mode} tool call cannot be combined with {params.structured.param}.",
                          param=params.structured.param)
    return dataclasses.replace(params, structured=constraint)


async def prepare_grammar(params: SamplingParams, engine: EngineClient) -> None:
    """Compile the request's output constraint now, in a worker thread (a 400 if it cannot be
    served), so that the engine thread finds it compiled."""
    if params.structured is not None:
        await engine.prepare_grammar(params.structured)


def fit_to_context(params: SamplingParams, prompt_lens: list[int], max_model_len: int, param: str) -> SamplingParams:
    """Check every prompt (and prompt + max_tokens) against the context window; `param` names
    the prompt's field (`messages` or `prompt`). Returns `params` with max_tokens filled in when
    it was left open (the room the longest prompt leaves)."""
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{longest} tokens, leaving no room for the completion. Please reduce the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=max_model_len - longest)
    if longest + params.max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest + params.max_tokens} tokens ({longest} in the prompt, {params.max_tokens} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return params
