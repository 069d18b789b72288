"""The OpenAI-compatible request and response bodies (pydantic), as OpenAI's and vLLM's servers accept
and return them.

Requests allow unknown fields (a client written for another server sends fields we do not know); the
serving code logs each unknown field name once and ignores it, except the OpenAI/vLLM fields cbserve
knows it cannot honour (server/unsupported_fields.py), which are a 400. Value ranges are checked here, so
a bad value is a 400 naming the field before anything reaches the engine.

Booleans and numbers are strict, as OpenAI's API is: ``"stream": "true"`` or ``"n": "2"`` is a 400, not
coerced; an integer where a number is expected stays valid (JSON has one number type).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from engine.loader.chat_template import RESERVED_TEMPLATE_VARIABLES

# NOTE: every stop string is checked after every token on the engine thread, so a request with thousands
# of them would slow every other request down; vLLM clients send a handful (OpenAI allows 4).
MAX_STOP_STRINGS = 256
# NOTE: OpenAI's own limit. Each tool's schema joins the grammar of a forced or ``auto`` call, which is
# compiled per request: the count bounds that work before anything is compiled.
MAX_TOOLS = 128
# The roles OpenAI's chat API defines. Any other string would reach the chat template verbatim, where it
# becomes prompt text (a role such as "user<|im_end|>..." forges turns).
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


def _json_number(value: Any) -> Any:
    """``value`` when it is a JSON number (an int or a float); strings and booleans are refused, which
    pydantic's lax float would coerce ("0.5" -> 0.5, true -> 1.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # NOTE: the value itself is not echoed: error messages may be logged, request data may not.
        kind = "boolean" if isinstance(value, bool) else type(value).__name__
        raise ValueError(f"must be a number, got a {kind}")
    return value


# A number field as OpenAI's API reads one: an int or a float, nothing coerced (ints become floats).
Number = Annotated[float, BeforeValidator(_json_number)]

# ---------------------------------------------------------------------------------------------- requests


def check_unicode(value: Any) -> Any:
    """``value`` unchanged when every string in it (dict keys included) is valid Unicode; else ValueError.

    JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), which Python keeps in a ``str`` that no UTF-8
    encoder (the tokenizer, a log line, a JSON response) can take: refused here, naming the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "is not valid Unicode text: it holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key)
            check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            check_unicode(item)
    return value


class RequestBody(BaseModel):
    """A request body, or a part of one: unknown fields allowed, every string valid Unicode."""

    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return check_unicode(value)


class StreamOptions(RequestBody):
    include_usage: StrictBool = False


class JSONSchemaFormat(RequestBody):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str | None = None
    description: str | None = None
    # NOTE: aliased: ``schema`` would shadow a pydantic BaseModel method.
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="The JSON Schema.")
    strict: StrictBool | None = None


class ResponseFormat(RequestBody):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(RequestBody):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    json_: dict[str, Any] | bool | StrictStr | None = Field(
        None, alias="json", description="A JSON Schema (object or JSON text)."
    )
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = Field(None, description="A Lark or GBNF grammar.")
    json_object: StrictBool | None = None


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=64, description="Samples per prompt.")
    max_tokens: StrictInt | None = Field(None, ge=1)
    prompt_logprobs: StrictInt | None = Field(
        None,
        ge=0,
        le=20,
        description="vLLM: each prompt token's log-probability, with this many alternatives.",
    )
    temperature: Number | None = Field(
        None, ge=0.0, description="0 = greedy; unset = the model's default, else 1.0."
    )
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1, description="-1 or 0 disables top-k.")
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    typical_p: Number | None = Field(None, gt=0.0, le=1.0, description="Locally typical sampling; 1 = off.")
    epsilon_cutoff: Number | None = Field(None, ge=0.0, lt=1.0, description="0 = off.")
    eta_cutoff: Number | None = Field(None, ge=0.0, lt=1.0, description="0 = off.")
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, description="1 = off.")
    no_repeat_ngram_size: StrictInt | None = Field(None, ge=0, description="0 = off.")
    bad_words: Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="Words never generated (vLLM's bad_words)."
    )
    logit_bias: dict[str, Number] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    skip_special_tokens: StrictBool = True
    user: str | None = None  # accepted and ignored, as the OpenAI API documents it
    # Structured outputs (server/structured_outputs.py): at most one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    dola_layers: (
        Literal["low", "high"] | Annotated[list[StrictInt], Field(min_length=1, max_length=256)] | None
    ) = Field(
        None,
        description="DoLa (transformers' dola_layers): contrast the last layer with 'low' or 'high' layers or "
        "these layer indices; use with repetition_penalty 1.2.",
    )
    penalty_alpha: Number | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Contrastive search (transformers' penalty_alpha): with top_k > 1, each token chosen among "
        "the top_k by (1 - penalty_alpha) * probability - penalty_alpha * its degeneration penalty; greedy, "
        "so temperature must be 0 or unset.",
    )
    # Speculative decoding (transformers' names): prompt lookup for this request, or the server's method tuned.
    prompt_lookup_num_tokens: StrictInt | None = Field(
        None, description="Prompt lookup decoding for this request: up to this many drafts a step (0: none)."
    )
    max_matching_ngram_size: StrictInt | None = Field(
        None, description="Prompt lookup: the longest n-gram matched against the prompt and output."
    )
    num_assistant_tokens: StrictInt | None = Field(
        None, description="Drafts a step at most, over the server's --speculative-config."
    )
    assistant_early_exit: StrictInt | None = Field(
        None, description="Self-speculative decoding: the model's first layers draft (how many)."
    )
    assistant_confidence_threshold: float | None = Field(
        None, description="Early exit: stop drafting when the draft's probability falls below this."
    )
    num_assistant_tokens_schedule: Literal["heuristic", "constant"] | None = Field(
        None, description="Adapt the drafts a step to their acceptance (heuristic) or not (constant)."
    )
    # transformers' WatermarkingConfig or SynthIDTextWatermarkingConfig fields (validated by the engine).
    watermarking_config: dict[str, Any] | None = Field(
        None,
        description="A watermark on the output: WatermarkingConfig or SynthIDTextWatermarkingConfig fields.",
    )
    # Beam search (server/beam_search_params.py): vLLM's fields, and transformers' num_beams as an extra.
    use_beam_search: StrictBool = Field(False, description="vLLM: beam search with best_of beams.")
    best_of: StrictInt | None = Field(
        None, ge=1, le=64, description="With use_beam_search: the number of beams (default n)."
    )
    num_beams: StrictInt | None = Field(None, ge=1, le=64, description="transformers: beam search when > 1.")
    num_beam_groups: StrictInt | None = Field(
        None, ge=1, le=64, description="transformers: diverse beam search with the beams in this many groups."
    )
    diversity_penalty: Number | None = Field(
        None, ge=0.0, description="Diverse beam search: subtracted per earlier group that chose the token."
    )
    force_words_ids: list[list[StrictInt] | list[list[StrictInt]]] | None = Field(
        None,
        max_length=64,
        description="Constrained beam search: token ids the output must contain (a list of lists: one of them).",
    )
    length_penalty: Number | None = Field(
        None, description="Beam search: a hypothesis scores sum(logprobs) / length ** length_penalty."
    )
    early_stopping: StrictBool | Literal["never"] | None = Field(
        None,
        description="Beam search: stop at num_beams finished hypotheses (true), by a heuristic (false), or never.",
    )
    # The arguments of the server's --logits-processors for this request (engine/generation/user_processors.py).
    logits_processor_args: dict[str, Any] | None = Field(
        None, description="Per-request arguments of the server's logits processors (--logits-processors)."
    )

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # NOTE: OpenAI's rule: stream_options only means something for a stream.
        if value is not None and info.data.get("stream") is not True:
            raise ValueError("is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        ..., description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Top log-probabilities per token.")
    echo: StrictBool = False


class TextContentPart(RequestBody):
    type: str
    text: str | None = None


class ToolCallFunction(RequestBody):
    name: StrictStr
    arguments: StrictStr = Field(..., description="The arguments as a JSON string.")


class ToolCall(RequestBody):
    """A tool call of an earlier assistant message."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestBody):
    role: ChatRole
    content: StrictStr | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: StrictStr | None = None  # tool messages: the call they answer


class FunctionDefinition(RequestBody):
    name: StrictStr = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: StrictBool | None = None


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: StrictStr


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='More chat template variables, e.g. {"enable_thinking": false}.'
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # NOTE: the server sets these itself; a request overriding them would forge the prompt's structure.
        reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise ValueError(f"must not set {', '.join(reserved)} (the server sets them)")
        return value


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = Field(
        None, description="Default: true for prompt, false for messages."
    )
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[StrictInt]


class WatermarkDetectRequest(RequestBody):
    """``/v1/watermark/detect``: a generated output (``text`` or ``tokens``) and the watermark it was
    generated with (default: the server's ``--watermarking-config``)."""

    model: str | None = None
    text: StrictStr | None = None
    tokens: list[StrictInt] | None = None
    watermarking_config: dict[str, Any] | None = None
    z_threshold: Number = Field(3.0, description="prediction is z_score > z_threshold.")
    ignore_repeated_ngrams: StrictBool = Field(False, description="Green list: count each n-gram once.")


# --------------------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``, keyed by token id: ``rank`` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's field, when asked


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI)


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None
    # A reasoning model's thinking (server/reasoning_output.py): vLLM's field, and its newer name.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's field, when asked


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cbserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class WatermarkDetectResponse(BaseModel):
    """transformers' WatermarkDetector numbers (green list), or SynthID's scores: a field that the
    watermark's kind does not have is left out."""

    num_tokens_scored: int
    num_green_tokens: int | None = None
    green_fraction: float | None = None
    mean_score: float | None = None
    weighted_mean_score: float | None = None
    z_score: float
    p_value: float
    prediction: bool


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# Documented in the OpenAPI schema of every route that can fail.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": desc}
    for status, desc in (
        (400, "Invalid request (bad value, malformed JSON, context length exceeded)"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "Waiting queue full"),
        (503, "Server draining or engine not running"),
    )
}
