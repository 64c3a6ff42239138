from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_MEMORY: _ClassVar[KvTier]
    KV_TIER_DISK: _ClassVar[KvTier]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_HEALTHY: _ClassVar[WorkerState]
    WORKER_STATE_UNHEALTHY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_MEMORY: KvTier
KV_TIER_DISK: KvTier
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_HEALTHY: WorkerState
WORKER_STATE_UNHEALTHY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_FAILED: WorkerState

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "structured", "prompt_logprobs", "n", "echo", "speculative")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    structured: StructuredOutput
    prompt_logprobs: int
    n: int
    echo: bool
    speculative: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., echo: _Optional[bool] = ..., speculative: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "chat", "sampling", "resume_token_ids", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort", "thinking_token_budget", "keep_alive_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tools: str
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    chat_template_kwargs: str
    reasoning_effort: str
    thinking_token_budget: int
    keep_alive_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ..., reasoning_effort: _Optional[str] = ..., thinking_token_budget: _Optional[int] = ..., keep_alive_seconds: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens", "cached_tokens_disk")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DISK_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    cached_tokens_disk: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cached_tokens_disk: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "stop_reason", "usage", "worker_id", "tool_calls", "reasoning", "index", "prompt_logprobs", "prompt_text", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    worker_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning: str
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., worker_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning: _Optional[str] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("model", "token_ids", "max_model_len", "worker_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    worker_id: str
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "owned_by", "tasks", "state", "status")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    owned_by: str
    tasks: _containers.RepeatedScalarFieldContainer[str]
    state: str
    status: str
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., owned_by: _Optional[str] = ..., tasks: _Optional[_Iterable[str]] = ..., state: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "model", "inputs", "dimensions", "normalize")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    normalize: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("index", "values")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    index: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "data", "usage", "worker_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    data: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    worker_id: str
    def __init__(self, model: _Optional[str] = ..., data: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "model", "queries", "documents", "instruction")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    queries: _containers.RepeatedScalarFieldContainer[str]
    documents: _containers.RepeatedScalarFieldContainer[str]
    instruction: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., queries: _Optional[_Iterable[str]] = ..., documents: _Optional[_Iterable[str]] = ..., instruction: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("model", "scores", "usage", "worker_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    scores: _containers.RepeatedScalarFieldContainer[float]
    usage: Usage
    worker_id: str
    def __init__(self, model: _Optional[str] = ..., scores: _Optional[_Iterable[float]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("kv_ack",)
    KV_ACK_FIELD_NUMBER: _ClassVar[int]
    kv_ack: KvAck
    def __init__(self, kv_ack: _Optional[_Union[KvAck, _Mapping]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("digest", "files")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    digest: str
    files: _containers.RepeatedCompositeFieldContainer[TokenizerFile]
    def __init__(self, digest: _Optional[str] = ..., files: _Optional[_Iterable[_Union[TokenizerFile, _Mapping]]] = ...) -> None: ...

class TokenizerFile(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class KvBlocks(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: bytes
    def __init__(self, hashes: _Optional[bytes] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "tier", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tier: KvTier
    stored: KvBlocks
    removed: KvBlocks
    cleared: bool
    def __init__(self, seq: _Optional[int] = ..., tier: _Optional[_Union[KvTier, str]] = ..., stored: _Optional[_Union[KvBlocks, _Mapping]] = ..., removed: _Optional[_Union[KvBlocks, _Mapping]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class KvSnapshot(_message.Message):
    __slots__ = ("seq", "memory_hashes", "disk_hashes", "part", "parts")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HASHES_FIELD_NUMBER: _ClassVar[int]
    DISK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    memory_hashes: bytes
    disk_hashes: bytes
    part: int
    parts: int
    def __init__(self, seq: _Optional[int] = ..., memory_hashes: _Optional[bytes] = ..., disk_hashes: _Optional[bytes] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("epoch", "block_size", "events", "snapshot")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    snapshot: KvSnapshot
    def __init__(self, epoch: _Optional[str] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., snapshot: _Optional[_Union[KvSnapshot, _Mapping]] = ...) -> None: ...

class KvAck(_message.Message):
    __slots__ = ("epoch", "seq", "resync", "next_part")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    NEXT_PART_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    resync: bool
    next_part: int
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., resync: _Optional[bool] = ..., next_part: _Optional[int] = ...) -> None: ...

class KvDiskInfo(_message.Message):
    __slots__ = ("enabled", "reason", "used_bytes", "budget_bytes", "read_tokens_per_second")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    reason: str
    used_bytes: int
    budget_bytes: int
    read_tokens_per_second: float
    def __init__(self, enabled: _Optional[bool] = ..., reason: _Optional[str] = ..., used_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., read_tokens_per_second: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "model", "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "max_num_seqs", "block_size", "max_model_len", "draining", "stalled", "state_slots_used", "state_slots_total", "tasks", "group", "features", "unhealthy_reason", "lagging", "resident_bytes", "kv", "kv_disk", "prefill_tokens_per_second", "queued_prefill_tokens", "tokenizer_digest")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    LAGGING_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    max_num_seqs: int
    block_size: int
    max_model_len: int
    draining: bool
    stalled: bool
    state_slots_used: int
    state_slots_total: int
    tasks: _containers.RepeatedScalarFieldContainer[str]
    group: GroupInfo
    features: _containers.RepeatedScalarFieldContainer[str]
    unhealthy_reason: str
    lagging: bool
    resident_bytes: int
    kv: KvEventBatch
    kv_disk: KvDiskInfo
    prefill_tokens_per_second: float
    queued_prefill_tokens: int
    tokenizer_digest: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., draining: _Optional[bool] = ..., stalled: _Optional[bool] = ..., state_slots_used: _Optional[int] = ..., state_slots_total: _Optional[int] = ..., tasks: _Optional[_Iterable[str]] = ..., group: _Optional[_Union[GroupInfo, _Mapping]] = ..., features: _Optional[_Iterable[str]] = ..., unhealthy_reason: _Optional[str] = ..., lagging: _Optional[bool] = ..., resident_bytes: _Optional[int] = ..., kv: _Optional[_Union[KvEventBatch, _Mapping]] = ..., kv_disk: _Optional[_Union[KvDiskInfo, _Mapping]] = ..., prefill_tokens_per_second: _Optional[float] = ..., queued_prefill_tokens: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("size", "parallel", "members")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    size: int
    parallel: str
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    def __init__(self, size: _Optional[int] = ..., parallel: _Optional[str] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("rank", "host", "memory_bytes", "weight_bytes", "first_layer", "last_layer", "step_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    memory_bytes: int
    weight_bytes: int
    first_layer: int
    last_layer: int
    step_seconds: float
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    def __init__(self, drain: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "num_running", "num_waiting")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    num_running: int
    num_waiting: int
    def __init__(self, draining: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "join_token", "load", "instance_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    join_token: str
    load: LoadReport
    instance_id: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., join_token: _Optional[str] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "join_token", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    join_token: str
    load: LoadReport
    def __init__(self, worker_id: _Optional[str] = ..., join_token: _Optional[str] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "kv_ack")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    KV_ACK_FIELD_NUMBER: _ClassVar[int]
    known: bool
    kv_ack: KvAck
    def __init__(self, known: _Optional[bool] = ..., kv_ack: _Optional[_Union[KvAck, _Mapping]] = ...) -> None: ...

class AddWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class AddWorkerResponse(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class RemoveWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class RemoveWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "model", "state", "load", "inflight", "static", "circuit", "failure", "node_id", "catalog_model")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    STATIC_FIELD_NUMBER: _ClassVar[int]
    CIRCUIT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CATALOG_MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model: str
    state: WorkerState
    load: LoadReport
    inflight: int
    static: bool
    circuit: str
    failure: WorkerFailure
    node_id: str
    catalog_model: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., inflight: _Optional[int] = ..., static: _Optional[bool] = ..., circuit: _Optional[str] = ..., failure: _Optional[_Union[WorkerFailure, _Mapping]] = ..., node_id: _Optional[str] = ..., catalog_model: _Optional[str] = ...) -> None: ...

class WorkerFailure(_message.Message):
    __slots__ = ("reason", "exit_code", "permanent", "age_seconds")
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    exit_code: int
    permanent: bool
    age_seconds: float
    def __init__(self, reason: _Optional[str] = ..., exit_code: _Optional[int] = ..., permanent: _Optional[bool] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("worker_id", "join_token", "model", "reason", "exit_code", "permanent")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    join_token: str
    model: str
    reason: str
    exit_code: int
    permanent: bool
    def __init__(self, worker_id: _Optional[str] = ..., join_token: _Optional[str] = ..., model: _Optional[str] = ..., reason: _Optional[str] = ..., exit_code: _Optional[int] = ..., permanent: _Optional[bool] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "drain")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    drain: bool
    def __init__(self, worker_id: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class DiskModel(_message.Message):
    __slots__ = ("name", "file_bytes", "weight_bytes", "kv_bytes_per_token", "num_layers", "max_context", "tasks", "error", "state_bytes_per_seq", "fetched", "last_used_seconds_ago")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    name: str
    file_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    num_layers: int
    max_context: int
    tasks: _containers.RepeatedScalarFieldContainer[str]
    error: str
    state_bytes_per_seq: int
    fetched: bool
    last_used_seconds_ago: float
    def __init__(self, name: _Optional[str] = ..., file_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., num_layers: _Optional[int] = ..., max_context: _Optional[int] = ..., tasks: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., state_bytes_per_seq: _Optional[int] = ..., fetched: _Optional[bool] = ..., last_used_seconds_ago: _Optional[float] = ...) -> None: ...

class ManagedWorker(_message.Message):
    __slots__ = ("worker_id", "model", "state", "reserved_bytes", "group_size", "group_rank", "exit_code", "reason", "progress", "address", "restarts")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    state: str
    reserved_bytes: int
    group_size: int
    group_rank: int
    exit_code: int
    reason: str
    progress: float
    address: str
    restarts: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[str] = ..., reserved_bytes: _Optional[int] = ..., group_size: _Optional[int] = ..., group_rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., progress: _Optional[float] = ..., address: _Optional[str] = ..., restarts: _Optional[int] = ...) -> None: ...

class NodeReport(_message.Message):
    __slots__ = ("node_id", "address", "advertise_host", "memory_budget_bytes", "memory_reserved_bytes", "memory_available_bytes", "disk_free_bytes", "models", "workers", "platform", "max_loaded", "instance_id", "transfers", "disk_budget_bytes", "disk_used_bytes", "transfer_totals")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_HOST_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MAX_LOADED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOTALS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    advertise_host: str
    memory_budget_bytes: int
    memory_reserved_bytes: int
    memory_available_bytes: int
    disk_free_bytes: int
    models: _containers.RepeatedCompositeFieldContainer[DiskModel]
    workers: _containers.RepeatedCompositeFieldContainer[ManagedWorker]
    platform: str
    max_loaded: int
    instance_id: str
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    disk_budget_bytes: int
    disk_used_bytes: int
    transfer_totals: _containers.RepeatedCompositeFieldContainer[TransferTotal]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., advertise_host: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., memory_reserved_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., models: _Optional[_Iterable[_Union[DiskModel, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[ManagedWorker, _Mapping]]] = ..., platform: _Optional[str] = ..., max_loaded: _Optional[int] = ..., instance_id: _Optional[str] = ..., transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., disk_budget_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., transfer_totals: _Optional[_Iterable[_Union[TransferTotal, _Mapping]]] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("source", "bytes_done", "bytes_total", "seconds")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    source: str
    bytes_done: int
    bytes_total: int
    seconds: float
    def __init__(self, source: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., seconds: _Optional[float] = ..., **kwargs) -> None: ...

class TransferTotal(_message.Message):
    __slots__ = ("kind", "bytes", "seconds", "fetches", "failures")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    bytes: int
    seconds: float
    fetches: int
    failures: int
    def __init__(self, kind: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., fetches: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("join_token", "report")
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    join_token: str
    report: NodeReport
    def __init__(self, join_token: _Optional[str] = ..., report: _Optional[_Union[NodeReport, _Mapping]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node_id", "heartbeat_interval_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_interval_ms: int
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class NodeHeartbeatRequest(_message.Message):
    __slots__ = ("join_token", "report")
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    join_token: str
    report: NodeReport
    def __init__(self, join_token: _Optional[str] = ..., report: _Optional[_Union[NodeReport, _Mapping]] = ...) -> None: ...

class NodeHeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("report", "state", "age_seconds")
    REPORT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    report: NodeReport
    state: str
    age_seconds: float
    def __init__(self, report: _Optional[_Union[NodeReport, _Mapping]] = ..., state: _Optional[str] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class CatalogModel(_message.Message):
    __slots__ = ("name", "source", "pin", "keep_alive_seconds", "max_nodes", "context", "engine_args", "replace", "state", "status", "placements", "footprint_bytes", "measured_bytes", "idle_seconds", "min_replicas", "max_replicas", "replicas", "fetch_progress")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ARGS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FETCH_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    pin: bool
    keep_alive_seconds: float
    max_nodes: int
    context: int
    engine_args: _containers.RepeatedScalarFieldContainer[str]
    replace: bool
    state: str
    status: str
    placements: _containers.RepeatedCompositeFieldContainer[ModelPlacement]
    footprint_bytes: int
    measured_bytes: int
    idle_seconds: float
    min_replicas: int
    max_replicas: int
    replicas: int
    fetch_progress: float
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., pin: _Optional[bool] = ..., keep_alive_seconds: _Optional[float] = ..., max_nodes: _Optional[int] = ..., context: _Optional[int] = ..., engine_args: _Optional[_Iterable[str]] = ..., replace: _Optional[bool] = ..., state: _Optional[str] = ..., status: _Optional[str] = ..., placements: _Optional[_Iterable[_Union[ModelPlacement, _Mapping]]] = ..., footprint_bytes: _Optional[int] = ..., measured_bytes: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., replicas: _Optional[int] = ..., fetch_progress: _Optional[float] = ...) -> None: ...

class ModelPlacement(_message.Message):
    __slots__ = ("node_id", "worker_id", "state", "group_rank", "group_size", "reserved_bytes", "progress")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    worker_id: str
    state: str
    group_rank: int
    group_size: int
    reserved_bytes: int
    progress: float
    def __init__(self, node_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., state: _Optional[str] = ..., group_rank: _Optional[int] = ..., group_size: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., progress: _Optional[float] = ...) -> None: ...

class RemoveModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCatalogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCatalogResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[CatalogModel]
    def __init__(self, models: _Optional[_Iterable[_Union[CatalogModel, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class FetchModelRequest(_message.Message):
    __slots__ = ("source", "peers", "first_layer", "last_layer", "protect")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    PROTECT_FIELD_NUMBER: _ClassVar[int]
    source: str
    peers: _containers.RepeatedCompositeFieldContainer[NodePeer]
    first_layer: int
    last_layer: int
    protect: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, source: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[NodePeer, _Mapping]]] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., protect: _Optional[_Iterable[str]] = ...) -> None: ...

class NodePeer(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class FetchProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "done", "path", "deleted")
    FROM_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    done: bool
    path: str
    deleted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., done: _Optional[bool] = ..., path: _Optional[str] = ..., deleted: _Optional[_Iterable[str]] = ..., **kwargs) -> None: ...

class DescribeModelRequest(_message.Message):
    __slots__ = ("source",)
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    source: str
    def __init__(self, source: _Optional[str] = ...) -> None: ...

class ListModelFilesRequest(_message.Message):
    __slots__ = ("source", "first_layer", "last_layer")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    source: str
    first_layer: int
    last_layer: int
    def __init__(self, source: _Optional[str] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ...) -> None: ...

class ModelFile(_message.Message):
    __slots__ = ("path", "size", "sha256", "blob")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    blob: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., blob: _Optional[str] = ...) -> None: ...

class ModelFiles(_message.Message):
    __slots__ = ("source", "revision", "files")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    source: str
    revision: str
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    def __init__(self, source: _Optional[str] = ..., revision: _Optional[str] = ..., files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ...) -> None: ...

class ReadModelFileRequest(_message.Message):
    __slots__ = ("source", "path", "offset")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    source: str
    path: str
    offset: int
    def __init__(self, source: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ReservePortsRequest(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class ReservePortsResponse(_message.Message):
    __slots__ = ("ports",)
    PORTS_FIELD_NUMBER: _ClassVar[int]
    ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ports: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerSpec(_message.Message):
    __slots__ = ("worker_id", "model", "source", "context", "kv_cache_bytes", "reserved_bytes", "engine_args", "port", "group_size", "group_rank", "group_hosts", "group_port", "group_shares", "memory_budget_bytes", "max_num_seqs", "num_kv_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ARGS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_HOSTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SHARES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    source: str
    context: int
    kv_cache_bytes: int
    reserved_bytes: int
    engine_args: _containers.RepeatedScalarFieldContainer[str]
    port: int
    group_size: int
    group_rank: int
    group_hosts: _containers.RepeatedScalarFieldContainer[str]
    group_port: int
    group_shares: str
    memory_budget_bytes: int
    max_num_seqs: int
    num_kv_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., source: _Optional[str] = ..., context: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., engine_args: _Optional[_Iterable[str]] = ..., port: _Optional[int] = ..., group_size: _Optional[int] = ..., group_rank: _Optional[int] = ..., group_hosts: _Optional[_Iterable[str]] = ..., group_port: _Optional[int] = ..., group_shares: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ...) -> None: ...

class StartWorkerRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: WorkerSpec
    def __init__(self, spec: _Optional[_Union[WorkerSpec, _Mapping]] = ...) -> None: ...

class StopWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "drain_timeout_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    drain_timeout_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., drain_timeout_seconds: _Optional[float] = ...) -> None: ...

class GetNodeReportRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
