"""Requests of the OpenAI API as vLLM's server reads them, checked field by field.

`parse_completion` / `parse_chat` turn a JSON body into token ids and `GenerationParams`, or raise
`APIError` naming the bad field (`param`): a wrong type, a value out of range, a prompt longer than the
server's context, token ids outside the vocabulary, a sampling option the engine does not have. Unknown
fields are ignored, as vLLM does. Defaults are OpenAI's: temperature 1, top_p 1, n 1, max_tokens 16 for
completions and the rest of the context for chat.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.serving.errors import APIError

MAX_LOGPROBS = 20  # top log-probs per token, as vLLM's default max_logprobs
MAX_N = 16  # choices per prompt
# Options the engine does not have: accepted only at the value that changes nothing.
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
           "min_tokens": (0,), "ignore_eos": (False,), "logit_bias": ({},), "suffix": ("",), "min_p": (0, 0.0),
           "tools": ([],), "response_format": ({"type": "text"},), "prompt_logprobs": (0,)}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server's engine holds: prompts of at most `max_prompt` tokens, prompt + new tokens at most
    `max_model_len`, ids below `vocab_size`."""

    max_prompt: int
    max_model_len: int
    vocab_size: int
    max_n: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    sampling: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # top log-probs per token (0: the chosen token's only); None: no log-probs
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None  # as sent (None: sent as token ids, or rendered from chat messages)


def _absent(body: dict, name: str) -> bool:
    return body.get(name) is None


def get_int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    if _absent(body, name):
        return default
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise APIError(f"{name} must be an integer, got {v!r}", param=name)
    if v < lo or (hi is not None and v > hi):
        raise APIError(f"{name}={v} is out of range: expected {lo} <= {name}" + (f" <= {hi}" if hi is not None else ""),
                       param=name)
    return v


def get_number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if _absent(body, name):
        return default
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(f"{name} must be a finite number, got {v!r}", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise APIError(f"{name}={v} is out of range: expected {lo} {'<' if lo_open else '<='} {name} <= {hi}",
                       param=name)
    return float(v)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    if _absent(body, name):
        return default
    if not isinstance(body[name], bool):
        raise APIError(f"{name} must be true or false, got {body[name]!r}", param=name)
    return body[name]


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise APIError(f"The model `{model}` does not exist; this server serves `{served}`", param="model",
                       status=404)


def _sampling(body: dict) -> SamplingParams:
    for name, neutral in NEUTRAL.items():
        if not _absent(body, name) and body[name] not in neutral:
            raise APIError(f"{name}={body[name]!r} is not supported by this server (only {neutral[0]!r})",
                           param=name)
    temperature = get_number(body, "temperature", 1.0, 0.0, 100.0)
    top_p = get_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = get_int(body, "top_k", 0, -1)
    if temperature == 0.0:
        return GREEDY  # top-k / top-p change nothing: one compiled decode step for every greedy request
    return SamplingParams(temperature, max(top_k, 0), top_p)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    return tuple(s for s in stop if s)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise APIError(f"stream_options must be an object, got {options!r}", param="stream_options")
    if not stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    return stream, get_bool(options, "include_usage")


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None, prompts: list[Prompt],
                limits: Limits) -> int:
    """The first of `names` given (else `default`, or the context the longest prompt leaves), within the
    context the longest prompt leaves."""
    longest = max(len(p.ids) for p in prompts)
    room = limits.max_model_len - longest
    name = next((n for n in names if not _absent(body, n)), names[0])
    asked = get_int(body, name, None, 0)
    if asked is None:
        return max(min(room, default if default is not None else room), 0)
    if asked > room:
        raise APIError(f"{name}={asked} is too large: the prompt has {longest} tokens and the server's context "
                       f"is {limits.max_model_len} tokens (prompt + {name} must fit it); ask for at most {room}",
                       param=name)
    return asked


def _check_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise APIError(f"{param} is empty (0 tokens): at least one token is needed", param=param)
    if len(ids) > limits.max_prompt:
        raise APIError(f"{param} has {len(ids)} tokens, more than this server's longest prompt of "
                       f"{limits.max_prompt} tokens (its context is {limits.max_model_len}); prompts are never "
                       f"truncated", param=param)
    bad = sorted({t for t in ids if not 0 <= t < limits.vocab_size})
    if bad:
        raise APIError(f"{param} holds token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:8]}",
                       param=param)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _encode(tokenizer: Any, text: str, param: str) -> list[int]:
    if tokenizer is None:
        raise APIError(f"{param} is text, but the model has no tokenizer: send token ids", param=param)
    return list(tokenizer.encode(text))


def parse_prompts(body: dict, tokenizer: Any, limits: Limits) -> list[Prompt]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of such lists."""
    raw = body.get("prompt")
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(p, str) or _is_ids(p) for p in raw):
        raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                       f"token ids (not empty), got {_describe(body.get('prompt'))}", param="prompt")
    prompts = [Prompt(_encode(tokenizer, p, "prompt"), p) if isinstance(p, str) else Prompt(list(p), None)
               for p in raw]
    for p in prompts:
        _check_ids(p.ids, limits, "prompt")
    return prompts


def _describe(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_completion(body: dict, tokenizer: Any, limits: Limits) -> tuple[list[Prompt], GenerationParams]:
    """POST /v1/completions."""
    prompts = parse_prompts(body, tokenizer, limits)
    stream, include_usage = _stream(body)
    params = GenerationParams(
        max_tokens=_max_tokens(body, ("max_tokens",), 16, prompts, limits), sampling=_sampling(body),
        n=get_int(body, "n", 1, 1, limits.max_n), stop=_stop(body), seed=get_int(body, "seed", None, -2**63),
        logprobs=get_int(body, "logprobs", None, 0, limits.max_logprobs), echo=get_bool(body, "echo"),
        stream=stream, include_usage=include_usage, return_token_ids=get_bool(body, "return_token_ids"))
    _check_best_of(body, params.n)
    return prompts, params


def _check_best_of(body: dict, n: int) -> None:
    best_of = get_int(body, "best_of", n, 1)
    if best_of != n:
        raise APIError(f"best_of={best_of} is not supported (only best_of == n)", param="best_of")


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(f"messages[{i}].content must be a string or a list of text parts, got {_describe(content)}",
                   param="messages")


def parse_messages(body: dict, tokenizer: Any, limits: Limits) -> Prompt:
    """`messages` (+ `chat_template_kwargs`, `add_generation_prompt`) through the tokenizer's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(f"messages must be a non-empty list of messages, got {_describe(messages)}", param="messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string `role`, got {_describe(m)}",
                           param="messages")
        turns.append({**m, "content": _content(m, i)})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(f"chat_template_kwargs must be an object, got {_describe(kwargs)}", param="chat_template_kwargs")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template: use /v1/completions", param="messages")
    reserved = {"conversation", "messages", "tokenize", "add_generation_prompt"} & set(kwargs)
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False,
                                             add_generation_prompt=get_bool(body, "add_generation_prompt", True),
                                             **kwargs)
    except APIError:
        raise
    except Exception as err:  # noqa: BLE001  (jinja2 errors, a template that wants other fields)
        raise APIError(f"the chat template failed on these messages: {err}", param="messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    _check_ids(ids, limits, "messages")
    return Prompt(ids, text)


def parse_chat(body: dict, tokenizer: Any, limits: Limits) -> tuple[Prompt, GenerationParams]:
    """POST /v1/chat/completions."""
    prompt = parse_messages(body, tokenizer, limits)
    stream, include_usage = _stream(body)
    want = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, 0, limits.max_logprobs)
    if top is not None and not want:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    params = GenerationParams(
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens"), None, [prompt], limits),
        sampling=_sampling(body), n=get_int(body, "n", 1, 1, limits.max_n), stop=_stop(body),
        seed=get_int(body, "seed", None, -2**63), logprobs=(top or 0) if want else None, stream=stream,
        include_usage=include_usage, return_token_ids=get_bool(body, "return_token_ids"))
    return prompt, params
