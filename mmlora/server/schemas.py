"""Request bodies of the HTTP API as strict pydantic models (schema errors become 422 answers).

Strict types, checked before anything is queued: no string-to-bool (``"yes"``), no bool-to-int
(``[true, false]`` as token ids), no string-to-number; integers fit int64; every string is valid Unicode
(a lone surrogate such as ``"\ud800"`` is refused with the field named). Value ranges that need the
engine (temperature, penalties, ``max_new_tokens`` against ``max_model_len``, token ids against the
vocabulary) are checked by ``SamplingParams`` and the engine, answered 400 naming the field.

``/generate`` follows SGLang's ``GenerateReqInput`` field names and refuses unknown fields; the OpenAI
bodies ignore fields they do not know (clients send optional extras) but refuse, with a clear message,
the known options that are not supported, rather than silently ignoring them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from mmlora.engine.sampling_params import INT64_LIMIT


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid Unicode: a lone surrogate {text[e.start]!r} at index {e.start}"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int64 = Annotated[int, Field(ge=-INT64_LIMIT, lt=INT64_LIMIT)]
TokenId = Annotated[int, Field(ge=0, lt=INT64_LIMIT)]
_STRICT = {"strict": True}


class SGLangSamplingParams(BaseModel):
    """``/generate``'s ``sampling_params``: types here; ranges and unknown names in ``SamplingParams``."""

    model_config = ConfigDict(extra="allow", **_STRICT)

    max_new_tokens: Int64 | None = None
    min_new_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: Int64 | None = None
    n: Int64 | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop_regex: Text | list[Text] | None = None
    # structured output (mmlora.engine.grammar): one of these; json_schema is a JSON string (or object)
    json_schema: Text | dict[Text, Any] | None = None
    regex: Text | None = None
    ebnf: Text | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields the client sent (unknown ones too: ``SamplingParams`` names them in its error)."""
        return self.model_dump(exclude_unset=True)


class GenerateRequest(BaseModel):
    """SGLang's native ``/generate`` body."""

    model_config = ConfigDict(extra="forbid", **_STRICT)

    text: Text | list[Text] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    lora_path: Text | list[Text | None] | None = None
    image_data: Text | list[Text | list[Text] | None] | None = None
    stream: bool = False
    # SGLang's clients send null for "not set" (sglang.Runtime.generate does for these three).
    return_logprob: bool | list[bool] | None = False
    top_logprobs_num: Int64 | list[Int64] | None = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: Int64 | list[Int64] | None = -1
    rid: Text | list[Text] | None = None
    session_id: Text | None = None  # SGLang sessions are not supported; null is accepted
    client_id: Text | None = None  # who the request is billed to under --schedule-policy vtc


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", **_STRICT)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(BaseModel):
    """Fields shared by completions and chat (OpenAI's, plus vLLM's common extras)."""

    model_config = ConfigDict(extra="ignore", **_STRICT)

    model: Text | None = None
    n: Int64 = 1
    stop: Text | list[Text] | None = None
    seed: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    # vLLM / SGLang extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    lora_path: Text | None = None
    # structured output: OpenAI's response_format and vLLM's guided_* extras (mmlora.server.structured)
    response_format: dict[Text, Any] | None = None
    guided_json: Text | dict[Text, Any] | None = None
    guided_regex: Text | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_OpenAISampling):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None
    suffix: Text | None = None
    prompt_logprobs: Int64 | None = None  # vLLM's extra: top-k logprobs of every prompt token


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", **_STRICT)

    role: Text
    content: Text | list[dict[Text, Any]] | None = None
    name: Text | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict[Text, Any]] | None = None
    tool_choice: Text | dict[Text, Any] | None = None


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    lora_name: Text = Field(min_length=1, max_length=256)
    lora_path: Text = Field(min_length=1)
    pinned: bool = False


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    lora_name: Text = Field(min_length=1)
