"""Request bodies of the HTTP API as pydantic models (schema errors become 422 answers).

``/generate`` follows SGLang's ``GenerateReqInput`` field names and refuses unknown fields; the OpenAI
bodies ignore fields they do not know (clients send optional extras) but refuse, with a clear message,
the known options that are not supported, rather than silently ignoring them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class GenerateRequest(BaseModel):
    """SGLang's native ``/generate`` body."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    lora_path: str | list[str | None] | None = None
    image_data: str | list[str | list[str] | None] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: int | list[int] = -1
    rid: str | list[str] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(BaseModel):
    """Fields shared by completions and chat (OpenAI's, plus vLLM's common extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM / SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    lora_path: str | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
