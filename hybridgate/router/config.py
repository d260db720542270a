"""The router's settings: worker timeouts, placement, prompts, and the response cache.

Data only (the settings root composes it): the names of the policies and cache
modes are declared here, and `router.policy` and `router.response_cache`
import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridgate.config import check_settings, setting

POLICIES = ("cost", "least_loaded", "round_robin", "power_of_two", "prefix_affinity")
CACHE_MODES = ("off", "memory", "redis")
# hybridgate.router.tools.FORMATS
TOOL_CALL_FORMATS = ("auto", "hermes", "llama3_json", "mistral", "generic", "harmony", "gemma4")
POOLINGS = ("file", "mean", "cls", "last")  # hybridgate.router.embeddings: the file's, or wire.PoolingType's names


@dataclass(frozen=True)
class RouterConfig:
    max_model_len: int | None = setting(None, "most tokens per sequence (default: the model's context)", low=2,
                                        flag="--max-model-len")
    startup_timeout_s: float = setting(120.0, "seconds to wait for a READY worker before giving up",
                                       flag="--worker-startup-timeout", low=0, low_open=True)
    dead_after_s: float = setting(1.0, "seconds of worker silence after which it counts as dead",
                                  flag="--worker-timeout", low=0, low_open=True)
    queue_size: int = setting(4096, "deltas buffered per request before it is aborted as too slow",
                              flag="--stream-queue-size", low=1)
    stream_coalesce: bool = setting(
        True, "a stream whose client has not yet taken its previous message (the door is still writing it) "
              "takes every token that arrived meanwhile in its next message: text, ids and logprobs joined in "
              "order, the finish last; a client that keeps up still gets one message per step; off: one message "
              "per worker step (or per --stream-interval ids)")
    stream_interval: int = setting(
        1, "ids per streamed message: at most one message per N ids, the first (for TTFT) and the last always "
           "sent at once (vLLM's, SGLang's and TensorRT-LLM's --stream-interval)", low=1)
    wait_for_workers: bool = setting(
        False, "keep waiting (up to the worker start-up timeout) for a worker whose ipc socket file does not "
               "exist yet, instead of exiting after saying so", flag="--wait-for-workers")
    resume_on_worker_loss: bool = setting(
        True, "resume a stream whose worker dies (or restarts) on another READY worker, or on the same one "
        "when it is back within the stall timeout, by prefilling the prompt plus the ids already streamed "
        "with the same seed; off: such a stream ends with UNAVAILABLE", flag="--resume-on-worker-loss")
    request_stall_timeout_s: float = setting(
        60.0, "seconds without progress (no token, no prefill chunk) after which a request is aborted on "
        "its worker and resumed elsewhere, or failed with UNAVAILABLE", low=0, low_open=True,
        flag="--request-stall-timeout")
    handoff_stall_s: float = setting(
        2.0, "seconds a gap in a hand-off's token indexes may stay open before its worker counts as lost",
        low=0, low_open=True)
    prompt_processes: int = setting(
        2, "processes that render and tokenize prompts over 8192 characters off the event loop, started on "
           "first use at a lower priority; 0: a thread instead (which still stalls the loop about 150 ms per MiB)",
        low=0)
    handoff_answer_s: float = setting(
        10.0, "seconds a hand-off waits for the CPU worker's answer to a reservation or an import before it runs "
              "on the GPU worker instead", low=0, low_open=True)

    policy: str = setting(
        "cost", "placement policy: cost (predicted TTFT and TPOT against the SLOs, spilling to the CPU tier), "
        "least_loaded, round_robin, power_of_two or prefix_affinity", choices=POLICIES)
    ttft_slo_s: float | None = setting(
        None, "TTFT objective of the cost policy, seconds (default: 3 x the unloaded TTFT of the fastest worker "
              "for each prompt's length)", flag="--ttft-slo", low=0, low_open=True)
    tpot_slo_s: float | None = setting(
        None, "TPOT objective of the cost policy, seconds (default: 3 x the fastest unloaded decode step)",
        flag="--tpot-slo", low=0, low_open=True)

    chat_template: str | None = setting(
        None, "a file holding a Jinja chat template to render chats with instead of the model's own "
              "(tokenizer.chat_template); a model without one (a base model) serves chats only with it")
    tool_call_format: str = setting(
        "auto", "how the model writes tool calls: auto (harmony for a gpt-oss file, gemma4 for a gemma4 file, "
                "else from the chat template: hermes for <tool_call>, mistral for [TOOL_CALLS], llama3_json for "
                "<|python_tag|>; generic for a template without tools), hermes, llama3_json, mistral, generic (tools "
                "in a system message, the answer a JSON envelope), harmony (gpt-oss's channels: the analysis is "
                "reasoning_content, calls go to=functions.NAME) or gemma4 (<|tool_call>call:NAME{...}<tool_call|>, "
                "thinking in <|channel>thought...<channel|> is reasoning_content)",
        choices=TOOL_CALL_FORMATS)

    max_constraint_bytes: int = setting(
        64 << 10, "bytes (UTF-8) of a request's output constraint: its JSON schema as compact JSON, regex, grammar, "
                  "or choices together", low=1)
    max_constraint_choices: int = setting(1000, "strings in a request's choice constraint", low=1)
    constraint_compile_threads: int = setting(
        2, "threads that compile requests' output constraints (JSON schemas, regexes, grammars, tools) to check "
           "them before they run; their own, so a burst of schemas never queues ahead of prompt tokenization or "
           "/detokenize", low=1)
    constraint_compile_timeout_s: float = setting(
        10.0, "seconds a request's output constraint may take to compile (queueing for a thread not counted); "
              "one that takes longer is refused as an invalid argument", low=0, low_open=True,
        flag="--constraint-compile-timeout")

    pooling: str = setting(
        "file", "how /v1/embeddings pools the final hidden states: file (the GGUF's <arch>.pooling_type), or mean, "
                "cls or last (llama.cpp's --pooling); a model whose file names none serves embeddings only with one "
                "of these", choices=POOLINGS)
    embedding_normalize: bool = setting(
        True, "L2-normalise embeddings (as OpenAI's and sentence-transformers' Normalize module); off: the pooled "
              "hidden state as the model gives it")
    matryoshka: bool = setting(
        False, "the model was trained with Matryoshka representation learning (Qwen3-Embedding is), so an "
               "embeddings request's `dimensions` may truncate its vectors; off: such a request is refused")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ResponseCacheConfig:
    """Whether answers of deterministic requests are cached, where, for how long, and how many bytes."""

    mode: str = setting(
        "off", "response cache of deterministic requests (temperature 0 or a seed): off, memory (an LRU in this "
               "gateway) or redis (shared through --redis-url); identical requests in flight share one generation "
               "whenever it is on", flag="--response-cache", choices=CACHE_MODES)
    ttl_s: float = setting(3600.0, "seconds a cached answer lives", flag="--response-cache-ttl", low=0,
                           low_open=True)
    max_bytes: int = setting(
        64 << 20, "bytes of cached answers held (memory: this gateway's LRU; redis: no one answer larger is "
                  "stored, and Redis's own maxmemory bounds the total)", flag="--response-cache-max-bytes", low=1)

    def __post_init__(self) -> None:
        check_settings(self)
