"""Requests in: a JSON body checked field by field (:mod:`llm_jax.server.fields`) into a typed request.

Fields follow OpenAI's API, with vLLM's extras under vLLM's names (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``add_generation_prompt``,
``prompt_logprobs``, …).
A field this server does not know is refused (as OpenAI does), as is a known one set to something the
engine cannot do (``suffix``, ``best_of`` other than ``n``, …); fields OpenAI
accepts without effect on generation (``user``, ``metadata``, …) are ignored. Every error names its
field in ``param``.

Structured outputs (``llm_jax.guided``): OpenAI's ``response_format`` (``json_object``, ``json_schema``),
and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) with
its older spellings ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; one per
request. Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``): :mod:`llm_jax.server.tools`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from llm_jax.guided import Choice, Grammar, Guided, Json, Regex
from llm_jax.sampling import Sampling
from llm_jax.server.fields import ApiError, Fields, check, check_kind, integer, kind_of, number, show, token_ids
from llm_jax.server.tools import ToolCalling, parse_tool_calling, template_message
from llm_jax.serving.batching import BIAS_WIDTH as MAX_LOGIT_BIAS  # logit_bias entries (OpenAI's limit too)

MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_STOP = 32  # stop strings per request
MAX_BAD_WORDS = 64  # bad_words per request (each one or two banned token sequences)
MAX_EMBEDDING_INPUTS = 2048  # inputs per embeddings request (OpenAI's limit)
MAX_BIAS = 100.0  # |logit_bias| values (OpenAI's range)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (as vLLM)
MAX_SEED = 2**63  # seeds are int64, as vLLM's; the engine draws with seed mod 2**32
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions' max_tokens default (OpenAI's); chat: the rest of the context
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """What the served model and engine allow, for checks that need them."""

    vocab_size: int
    max_logprobs: int
    embedding_dim: int = 0  # the model's hidden size (embeddings' dimensions at most)
    # What requests that leave them out get: the model's recommended sampling settings and max_tokens
    # (``llm_jax.server.defaults``); the API's own defaults otherwise.
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The arguments the server's logits processors read (``--logits-processors``), with their defaults.
    processor_arguments: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    """What a completion or chat request asks of each of its choices."""

    max_tokens: int | None  # None: until the context is full
    min_tokens: int
    n: int
    sampling: Sampling  # its seed is ``seed`` (or a random one) when the request runs
    seed: int | None  # None: a fresh random seed per request
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None  # top alternatives reported per token (0: the token's own); None: no logprobs
    stream: bool
    include_usage: bool  # a usage chunk before [DONE]
    continuous_usage: bool  # usage on every chunk (vLLM's continuous_usage_stats)
    # vLLM's prompt_logprobs: each prompt token's log-probability and rank, with this many alternatives,
    # reported beside the choices (never streamed, as vLLM's)
    prompt_logprobs: int | None = None
    echo_logprobs: int | None = None  # completions' echo with logprobs: the echoed prompt's alternatives
    scored_prompt: int | None = None  # alternatives the engine reports per prompt token (None: no scores)
    guided: Guided | None = None  # a constraint the output follows (structured outputs)
    bad_words: tuple[str, ...] = ()  # words never to complete (vLLM's bad_words; the service tokenizes them)
    guided_param: str | None = None  # the field that gave it
    skip_special_tokens: bool = True  # False: the text keeps special tokens (vLLM's field)
    guided_after_token: int | None = None  # the constraint starts after this token (a reasoning's end)
    lora: str | None = None  # the LoRA adapter the request's "model" names (None: the base model)
    beam_search: BeamOptions | None = None  # vLLM's use_beam_search: n beams, the n best returned
    include_stop_str_in_output: bool = False  # the text ends with the stop string that ended it (vLLM's field)
    priority: int = 0  # lower runs first (vLLM's field; needs --scheduling-policy priority)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context's worth)
    cache_salt: str | None = None  # share cached prefixes only with requests of the same salt (vLLM's)
    processor_args: dict[str, float] | None = None  # vLLM's vllm_xargs: arguments of the logits processors


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamOptions:
    """A beam search's options, as ``transformers``' (``llm_jax.beams``)."""

    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"


Prompt = str | tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[Prompt, ...]
    echo: bool
    generation: Generation


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any]
    generation: Generation
    tools: ToolCalling | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None  # or messages, rendered through the chat template
    messages: tuple[dict[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    tools: ToolCalling | None = None  # shown to the chat template with messages
    return_token_strs: bool = False  # each token's vocabulary entry too (vLLM's ``token_strs``)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DetokenizeRequest:
    model: str | None
    tokens: tuple[int, ...]


# --- generation settings ------------------------------------------------------------------------------


def _stop(fields: Fields) -> tuple[str, ...]:
    stop = fields.take("stop", "string", "array", default=[])
    stop = [stop] if isinstance(stop, str) else stop
    check(len(stop) <= MAX_STOP, "stop", f"may hold at most {MAX_STOP} strings, got {len(stop)}")
    for i, s in enumerate(stop):
        check_kind(s, f"stop[{i}]", "string")
        check(s != "", "stop", "must not hold an empty string")
    return tuple(stop)


def _logit_bias(fields: Fields, vocab_size: int) -> dict[int, float]:
    bias = fields.take("logit_bias", "object", default={})
    check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(f"logit_bias keys must be token ids, got {show(key)}", param="logit_bias",
                           code="invalid_value") from None
        check(0 <= token < vocab_size, "logit_bias",
              f"names token id {token}, outside the vocabulary [0, {vocab_size})")
        check_kind(value, f"logit_bias[{key}]", "number")
        check(-MAX_BIAS <= value <= MAX_BIAS, "logit_bias", f"values must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out


def read_sampling(fields: Fields, limits: Limits) -> Sampling:
    """The sampling fields every generation endpoint takes (those left out: ``limits.defaults``)."""
    d = limits.defaults
    temperature = number(fields, "temperature", d.get("temperature", 1.0), lambda t: 0 <= t <= 2, "in [0, 2]")
    top_k = fields.take("top_k", "integer", default=d.get("top_k", 0))
    check(top_k >= -1, "top_k", f"must be -1 or 0 (off) or positive, got {top_k}")
    penalties = {name: number(fields, name, 0.0, lambda p: -MAX_PENALTY <= p <= MAX_PENALTY, "in [-2, 2]")
                 for name in ("presence_penalty", "frequency_penalty")}
    return Sampling(
        temperature=0.0 if temperature < SAMPLING_EPS else temperature,
        top_k=min(max(top_k, 0), limits.vocab_size),  # beyond the vocabulary: all of it
        top_p=number(fields, "top_p", d.get("top_p", 1.0), lambda p: 0 < p <= 1, "in (0, 1]"),
        min_p=number(fields, "min_p", d.get("min_p", 0.0), lambda p: 0 <= p <= 1, "in [0, 1]"),
        typical_p=number(fields, "typical_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1]"),
        repetition_penalty=number(fields, "repetition_penalty", d.get("repetition_penalty", 1.0),
                                  lambda p: 0 < p <= 2, "in (0, 2]"),
        logit_bias=_logit_bias(fields, limits.vocab_size), **penalties)


def _generation(fields: Fields, limits: Limits, *, max_tokens: int | None, logprobs: int | None) -> Generation:
    """The fields completions and chat share; ``max_tokens`` and ``logprobs`` are read by the caller."""
    n = integer(fields, "n", 1, MAX_N, default=1)
    fields.unsupported("best_of", accepted=n, why="is not supported: only best_of = n")
    include_stop = fields.take("include_stop_str_in_output", "boolean", default=False)
    priority = integer(fields, "priority", -2**31, 2**31 - 1, default=0)
    skip_special = fields.take("skip_special_tokens", "boolean", default=True)
    prompt_logprobs = integer(fields, "prompt_logprobs", 0, limits.max_logprobs)
    min_tokens = integer(fields, "min_tokens", 0, 2**31 - 1, default=0)
    if max_tokens is not None:
        check(min_tokens <= max_tokens, "min_tokens", f"({min_tokens}) must not exceed max_tokens ({max_tokens})")
    seed = integer(fields, "seed", -MAX_SEED, MAX_SEED - 1)
    stop = _stop(fields)
    stop_ids = fields.take("stop_token_ids", "array", default=[])
    stop_ids = token_ids(stop_ids, "stop_token_ids", limits.vocab_size) if stop_ids else ()
    stream = fields.take("stream", "boolean", default=False)
    if stream and prompt_logprobs:  # vLLM's refusal: its streams carry no prompt log-probabilities
        raise ApiError("prompt_logprobs are not available with stream=true", param="prompt_logprobs",
                       code="invalid_value")
    options = fields.take("stream_options", "object", default=None)
    if options is not None and not stream:
        raise ApiError("stream_options can only be given with stream=true", param="stream_options",
                       code="invalid_value")
    options = Fields(options or {})
    include_usage = options.take("include_usage", "boolean", default=False)
    continuous = options.take("continuous_usage_stats", "boolean", default=False)
    try:
        options.finish()
    except ApiError as error:
        raise ApiError(f"stream_options: {error.message}", param="stream_options", code=error.code) from None
    bad_words = fields.take("bad_words", "array", default=[])
    check(len(bad_words) <= MAX_BAD_WORDS, "bad_words", f"may hold at most {MAX_BAD_WORDS} words, got {len(bad_words)}")
    for i, word in enumerate(bad_words):
        check_kind(word, f"bad_words[{i}]", "string")
        check(word.strip() != "", "bad_words", "must not hold an empty word")
    guided, guided_param = _guided(fields)
    beam_search = _beam_search(fields)
    truncate = truncation(fields)
    cache_salt = fields.take("cache_salt", "string")
    check(cache_salt is None or cache_salt != "", "cache_salt", "must not be empty")
    processor_args = _processor_args(fields, limits)
    return Generation(max_tokens=max_tokens, min_tokens=min_tokens, n=n, sampling=read_sampling(fields, limits),
                      seed=seed, stop=stop, stop_token_ids=stop_ids,
                      ignore_eos=fields.take("ignore_eos", "boolean", default=False), logprobs=logprobs,
                      stream=stream, include_usage=include_usage, continuous_usage=continuous, guided=guided,
                      guided_param=guided_param, bad_words=tuple(bad_words), skip_special_tokens=skip_special,
                      include_stop_str_in_output=include_stop, priority=priority,
                      prompt_logprobs=None if stream else prompt_logprobs, beam_search=beam_search,
                      truncate_prompt_tokens=truncate, cache_salt=cache_salt, processor_args=processor_args)


def _processor_args(fields: Fields, limits: Limits) -> dict[str, float] | None:
    """vLLM's ``vllm_xargs``: numbers for the arguments the server's logits processors read."""
    value = fields.take("vllm_xargs", "object")
    if value is None:
        return None
    known = limits.processor_arguments
    for name, given in value.items():
        check(name in known, f"vllm_xargs.{name}",
              "is not an argument of this server's logits processors ("
              + (f"they read {sorted(known)})" if known else "it has none that read arguments)"))
        check(isinstance(given, (int, float)) and not isinstance(given, bool) and math.isfinite(given),
              f"vllm_xargs.{name}", f"must be a finite number, got {show(given)}")
    return {name: float(given) for name, given in value.items()}


def truncation(fields: Fields) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: k keeps the prompt's last k tokens, -1 as many as the context holds."""
    k = integer(fields, "truncate_prompt_tokens", -1, 2**31 - 1)
    check(k != 0, "truncate_prompt_tokens", "must be -1 or positive, got 0")
    return k


def truncate(ids: tuple[int, ...], k: int | None, max_model_len: int) -> tuple[int, ...]:
    """``ids`` left-truncated as ``truncate_prompt_tokens`` asks (vLLM's rule: the last k tokens)."""
    if k is None:
        return ids
    check(k <= max_model_len, "truncate_prompt_tokens", f"({k}) exceeds the model's context ({max_model_len})")
    return ids[-(max_model_len if k == -1 else k):]


def _beam_search(fields: Fields) -> BeamOptions | None:
    """vLLM's ``use_beam_search`` and its ``length_penalty`` (and ``transformers``' ``early_stopping``),
    which mean nothing without it."""
    use = fields.take("use_beam_search", "boolean", default=False)
    length_penalty = number(fields, "length_penalty", 1.0, math.isfinite, "a finite number")
    early_stopping = fields.take("early_stopping", "boolean", "string", default=False)
    check(early_stopping in (True, False, "never"), "early_stopping", f"must be true, false or \"never\", got "
                                                                      f"{show(early_stopping)}")
    if not use:
        for name, value, neutral in (("length_penalty", length_penalty, 1.0),
                                     ("early_stopping", early_stopping, False)):
            check(value == neutral, name, "needs use_beam_search=true")
        return None
    return BeamOptions(length_penalty=length_penalty, early_stopping=early_stopping)


def check_beam_search(generation: Generation) -> None:
    """What a beam search cannot do, refused by name: it is deterministic (it ranks the model's
    log-probabilities), reports no log-probabilities, follows no constraint and ends at end ids only."""
    if generation.beam_search is None:
        return
    s = generation.sampling
    unsupported = {"temperature": s.temperature not in (0.0, 1.0), "top_p": s.top_p < 1, "top_k": s.top_k > 0,
                   "min_p": s.min_p > 0, "typical_p": s.typical_p < 1,
                   "logprobs": generation.logprobs is not None,
                   "prompt_logprobs": generation.prompt_logprobs is not None or generation.echo_logprobs is not None,
                   "stop": bool(generation.stop), generation.guided_param or "structured_outputs": generation.guided
                   is not None, "skip_special_tokens": not generation.skip_special_tokens,
                   "model": generation.lora is not None}
    for name, used in unsupported.items():
        if used:
            why = "a LoRA adapter" if name == "model" else name
            raise ApiError(f"use_beam_search does not support {why}", param=name, code="unsupported")


def _prompt_scores(generation: Generation, limits: Limits, *, echo_logprobs: int | None = None) -> Generation:
    """What the engine scores of the prompt: the alternatives vLLM's ``prompt_logprobs`` reports (which an
    echo with logprobs also reports, as vLLM's does, unless streamed) or the echo shows, the more of them."""
    reported = generation.prompt_logprobs
    if reported is None and not generation.stream:
        reported = echo_logprobs
    scored = None if reported is None and echo_logprobs is None else max(reported or 0, echo_logprobs or 0)
    return dataclasses.replace(generation, prompt_logprobs=reported, echo_logprobs=echo_logprobs,
                               scored_prompt=scored)


def _schema(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema: an object, or a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ApiError(f"{param} is not valid JSON: {error}", param=param, code="invalid_value") from None
    return check_kind(value, param, "object")


def _choices(value: Any, param: str) -> Choice:
    check_kind(value, param, "array")
    check(len(value) > 0, param, "must not be empty")
    for i, option in enumerate(value):
        check_kind(option, f"{param}[{i}]", "string")
    return Choice(tuple(value))


def _response_format(value: dict[str, Any]) -> Guided | None:
    """OpenAI's ``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}``."""
    fields = Fields(value)
    kind = fields.required("type", "string")
    spec = fields.take("json_schema", "object")
    fields.finish()
    if kind == "text":
        return None
    if kind == "json_object":
        return Json()
    if kind != "json_schema":
        raise ApiError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {show(kind)}",
                       param="response_format.type", code="invalid_value")
    if spec is None:
        raise ApiError("response_format.json_schema is required with type 'json_schema'",
                       param="response_format.json_schema", code="missing_field")
    spec = Fields(spec)
    spec.required("name", "string")
    spec.take("description", "string")
    spec.take("strict", "boolean")
    schema = _schema(spec.take("schema", "object", default={}), "response_format.json_schema.schema")
    spec.finish()
    return Json(schema)


def structured_outputs(value: dict[str, Any], param: str = "structured_outputs") -> Guided:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    fields = Fields(value)
    found = [(name, fields.take(name, *kinds)) for name, kinds in
             (("json", ("object", "string")), ("regex", ("string",)), ("choice", ("array",)),
              ("grammar", ("string",)), ("json_object", ("boolean",)))]
    found = [(name, v) for name, v in found if v is not None and v is not False]
    fields.finish()
    if len(found) != 1:
        raise ApiError(f"{param} must give exactly one of json, regex, choice, grammar, json_object; got "
                       f"{[name for name, _ in found]}", param=param, code="invalid_value")
    (name, v), = found
    return _guided_value(name, v, f"{param}.{name}")


def _guided_value(kind: str, value: Any, param: str) -> Guided:
    if kind == "json":
        return Json(_schema(value, param))
    if kind == "json_object":
        return Json()
    if kind == "regex":
        return Regex(value)
    if kind == "choice":
        return _choices(value, param)
    return Grammar(value)


def nested(name: str, parse, value: Any) -> Guided | None:
    """``parse(value)`` of an object field, its errors named under ``name``."""
    try:
        return parse(value)
    except ApiError as error:
        param = error.param if (error.param or "").startswith(name) else name
        message = error.message if error.message.startswith(name) else f"{name}: {error.message}"
        raise ApiError(message, param=param, code=error.code) from None


def _guided(fields: Fields) -> tuple[Guided | None, str | None]:
    """The request's constraint, and the field it came from (at most one field gives one)."""
    given: list[tuple[str, Guided | None]] = []
    response_format = fields.take("response_format", "object")
    if response_format is not None:
        given.append(("response_format", nested("response_format", _response_format, response_format)))
    structured = fields.take("structured_outputs", "object")
    if structured is not None:
        given.append(("structured_outputs", nested("structured_outputs", structured_outputs, structured)))
    for name, kinds in (("guided_json", ("object", "string")), ("guided_regex", ("string",)),
                        ("guided_choice", ("array",)), ("guided_grammar", ("string",))):
        value = fields.take(name, *kinds)
        if value is not None:
            given.append((name, _guided_value(name.removeprefix("guided_"), value, name)))
    given = [(name, g) for name, g in given if g is not None]
    if len(given) > 1:
        raise ApiError(f"give one of {', '.join(name for name, _ in given)}: each constrains the output",
                       param=given[1][0], code="invalid_value")
    return (given[0][1], given[0][0]) if given else (None, None)


# --- the requests -------------------------------------------------------------------------------------


def prompt_inputs(value: Any, vocab_size: int, param: str = "prompt") -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    expected = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise ApiError(f"{param} must be {expected}, got {show(value)}", param=param, code="invalid_type")
    check(len(value) > 0, param, "must not be empty")
    kinds = {kind_of(item) for item in value}
    if kinds == {"string"}:
        return tuple(value)
    if kinds == {"integer"}:
        return (token_ids(value, param, vocab_size),)
    if kinds == {"array"}:
        return tuple(token_ids(ids, f"{param}[{i}]", vocab_size) for i, ids in enumerate(value))
    raise ApiError(f"{param} must be {expected}, got {show(value)}", param=param, code="invalid_type")


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    prompts = prompt_inputs(fields.required("prompt", "string", "array"), limits.vocab_size)
    max_tokens = integer(fields, "max_tokens", 1, 2**31 - 1,
                         default=limits.defaults.get("max_tokens", DEFAULT_COMPLETION_TOKENS))
    logprobs = integer(fields, "logprobs", 0, limits.max_logprobs)
    echo = fields.take("echo", "boolean", default=False)
    fields.unsupported("suffix", why="is not supported: the served model does not fill in the middle")
    generation = _generation(fields, limits, max_tokens=max_tokens, logprobs=logprobs)
    # The echoed prompt's tokens come with their log-probabilities when it asks for logprobs.
    generation = _prompt_scores(generation, limits, echo_logprobs=logprobs if echo else None)
    fields.finish()
    return CompletionRequest(model=model, prompts=prompts, echo=echo, generation=generation)


def _content(value: Any, param: str) -> str | None:
    """A message's content: a string, null, or a list of text parts (joined by newlines, as vLLM)."""
    if value is None or isinstance(value, str):
        return value
    check_kind(value, param, "string", "array")
    texts = []
    for i, part in enumerate(value):
        part_param = f"{param}[{i}]"
        check_kind(part, part_param, "object")
        check(part.get("type") == "text", part_param, f"must be a text part (only text is supported), got type "
                                                      f"{show(part.get('type'))}")
        texts.append(check_kind(part.get("text"), f"{part_param}.text", "string"))
    return "\n".join(texts)


def messages(value: Any, param: str = "messages") -> tuple[dict[str, Any], ...]:
    """A non-empty list of ``{"role", "content", …}`` objects; other message fields pass to the template."""
    check_kind(value, param, "array")
    check(len(value) > 0, param, "must not be empty")
    out = []
    for i, message in enumerate(value):
        check_kind(message, f"{param}[{i}]", "object")
        role = check_kind(message.get("role"), f"{param}[{i}].role", "string")
        check(role in ROLES, f"{param}[{i}].role", f"must be one of {sorted(ROLES)}, got {show(role)}")
        message = {**message, "content": _content(message.get("content"), f"{param}[{i}].content")}
        out.append(template_message(message, f"{param}[{i}]"))
    return tuple(out)


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    chat = messages(fields.required("messages", "array"))
    completion_tokens = integer(fields, "max_completion_tokens", 1, 2**31 - 1)
    max_tokens = integer(fields, "max_tokens", 1, 2**31 - 1)
    max_tokens = completion_tokens if completion_tokens is not None else max_tokens
    max_tokens = limits.defaults.get("max_tokens") if max_tokens is None else max_tokens
    wants_logprobs = fields.take("logprobs", "boolean", default=False)
    top = integer(fields, "top_logprobs", 0, limits.max_logprobs)
    if top is not None and not wants_logprobs:
        raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    tools = parse_tool_calling(fields)
    add_generation_prompt = fields.take("add_generation_prompt", "boolean", default=True)
    continue_final = fields.take("continue_final_message", "boolean", default=False)
    if add_generation_prompt and continue_final:
        raise ApiError("continue_final_message needs add_generation_prompt=false", param="continue_final_message",
                       code="invalid_value")
    kwargs = fields.take("chat_template_kwargs", "object", default={})
    generation = _generation(fields, limits, max_tokens=max_tokens, logprobs=(top or 0) if wants_logprobs else None)
    generation = _prompt_scores(generation, limits)
    fields.finish()
    if tools is not None and tools.forced:  # the output is the calls: constrained to their JSON
        if generation.guided is not None:
            forced = f"tool_choice {show(tools.choice)}" if isinstance(tools.choice, str) else "a named tool_choice"
            raise ApiError(f"{generation.guided_param} cannot be given with {forced}: the output is the tool calls",
                           param="tool_choice", code="invalid_value")
        generation = dataclasses.replace(generation, guided=tools.constraint(), guided_param="tools")
    return ChatRequest(model=model, messages=chat, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final, template_kwargs=kwargs, generation=generation,
                       tools=tools)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolingInput:
    """What a pooling request (embeddings, classification) reads: ``input`` (texts or token ids), or
    ``messages``, one conversation the chat template renders (vLLM's chat form: ``add_generation_prompt``
    default false, ``continue_final_message``, ``chat_template_kwargs``)."""

    inputs: tuple[Prompt, ...] | None  # None: the conversation
    messages: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def pooling_input(fields: Fields, limits: Limits) -> PoolingInput:
    given, chat = fields.take("input", "string", "array"), fields.take("messages", "array")
    if (given is None) == (chat is None):
        raise ApiError("give either input or messages", param="input", code="missing_field")
    inputs = None
    if given is not None:
        inputs = prompt_inputs(given, limits.vocab_size, "input")
        check(len(inputs) <= MAX_EMBEDDING_INPUTS, "input",
              f"may hold at most {MAX_EMBEDDING_INPUTS} inputs, got {len(inputs)}")
    add_generation_prompt = fields.take("add_generation_prompt", "boolean", default=False)
    continue_final = fields.take("continue_final_message", "boolean", default=False)
    kwargs = fields.take("chat_template_kwargs", "object", default={})
    if chat is None and (add_generation_prompt or continue_final or kwargs):
        raise ApiError("add_generation_prompt, continue_final_message and chat_template_kwargs go with messages",
                       param="messages", code="invalid_value")
    if add_generation_prompt and continue_final:
        raise ApiError("continue_final_message needs add_generation_prompt=false", param="continue_final_message",
                       code="invalid_value")
    return PoolingInput(inputs=inputs, messages=None if chat is None else messages(chat),
                        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
                        template_kwargs=kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingsRequest:
    model: str | None
    source: PoolingInput
    encoding_format: str  # "float" or "base64" (little-endian float32)
    dimensions: int | None  # keep the first dimensions (normalized after)
    truncate_prompt_tokens: int | None = None  # keep each input's last k tokens (-1: the context's worth)


def parse_embeddings(body: Any, limits: Limits) -> EmbeddingsRequest:
    """OpenAI's embeddings request: ``input`` (as completions' ``prompt``, at most MAX_EMBEDDING_INPUTS) or
    vLLM's ``messages`` (:func:`pooling_input`), ``encoding_format``, ``dimensions``."""
    fields = Fields(body)
    model = fields.take("model", "string")
    source = pooling_input(fields, limits)
    encoding = fields.take("encoding_format", "string", default="float")
    check(encoding in ("float", "base64"), "encoding_format", f"must be 'float' or 'base64', got {show(encoding)}")
    dimensions = integer(fields, "dimensions", 1, limits.embedding_dim)
    truncate_tokens = truncation(fields)
    fields.take("user", "string")
    fields.finish()
    return EmbeddingsRequest(model=model, source=source, encoding_format=encoding, dimensions=dimensions,
                             truncate_prompt_tokens=truncate_tokens)


def parse_tokenize(body: Any) -> TokenizeRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    prompt = fields.take("prompt", "string")
    chat = fields.take("messages", "array")
    if (prompt is None) == (chat is None):
        raise ApiError("give either prompt or messages", param="prompt", code="missing_field")
    add_special = fields.take("add_special_tokens", "boolean", default=chat is None)
    add_generation_prompt = fields.take("add_generation_prompt", "boolean", default=True)
    tools = parse_tool_calling(fields)
    if tools is not None and chat is None:
        raise ApiError("tools go with messages (for the chat template), not with prompt", param="tools",
                       code="invalid_value")
    token_strs = fields.take("return_token_strs", "boolean", default=False)
    fields.finish()
    return TokenizeRequest(model=model, prompt=prompt, messages=None if chat is None else messages(chat),
                           add_special_tokens=add_special, add_generation_prompt=add_generation_prompt, tools=tools,
                           return_token_strs=token_strs)


def parse_detokenize(body: Any, limits: Limits) -> DetokenizeRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    tokens = token_ids(fields.required("tokens", "array"), "tokens", limits.vocab_size)
    fields.finish()
    return DetokenizeRequest(model=model, tokens=tokens)


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, *, param: str) -> int:
    """The completion's token budget for a prompt of ``num_prompt`` tokens, or an error when it does not
    fit the context (``param``: the prompt's field)."""
    if max_tokens is None:
        if num_prompt >= max_model_len:
            raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                           f"has {num_prompt} tokens, which leaves no room for a completion. Please shorten it.",
                           param=param, code="context_length_exceeded")
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the "
                       "completion). Please reduce the prompt or the completion length.",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens
