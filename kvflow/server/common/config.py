"""ServerConfig: the HTTP server's own settings (the engine's are EngineConfig), built once, validated, frozen."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.config import parse_bytes

# --tool-call-parser's names: the parsers serving/tool_calls.py implements (TOOL_PARSERS, keyed by these; a test
# checks the two agree). Named here so that the config, below every surface, needs nothing of the chat route.
TOOL_PARSERS = ("hermes", "json", "qwen3_coder", "qwen3_xml", "llama3_json", "llama4_json", "pythonic",
                "llama4_pythonic", "mistral", "granite", "gemma4")
# --reasoning-parser's names, vLLM's: the splitters serving/reasoning.py implements (SPLITTERS, keyed by these)
REASONING_PARSERS = ("deepseek_r1", "granite", "qwen3")

# OpenAI's API rejects n > 128, and 128 is the default max_num_seqs: one request can fill at most one batch.
# (vLLM's VLLM_MAX_N_SEQUENCES defaults to 16384, sized for GPUs; on a CPU that is minutes of one request.)
DEFAULT_MAX_N = 128
# A full 128k-token context is ~0.5 MB of text, ~3 MB if every character is JSON-escaped, ~1 MB as token ids;
# 8 MiB leaves room for that and bounds the JSON parsing that still runs on the event loop to ~0.1 s.
DEFAULT_MAX_REQUEST_BODY_SIZE = 8 * 2**20
# OpenAI's limit for a batch input file
DEFAULT_MAX_BATCH_FILE_SIZE = 200 * 2**20
DEFAULT_BATCH_MIN_FREE_SPACE = 256 * 2**20
DEFAULT_BATCH_DIR = "~/.cache/kvflow/batches"
DEFAULT_REQUEST_LOG_MAX_BYTES = 100 * 2**20
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def json_list(value: str) -> tuple[str, ...]:
    """A flag's JSON list of strings, as vLLM reads --allowed-origins: '["http://localhost:3000", "https://x.io"]'."""
    try:
        items = json.loads(value)
    except ValueError:
        raise ValueError(f"not a JSON list of strings: {value!r}") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"not a JSON list of strings: {value!r}")
    return tuple(items)


json_list.__name__ = "JSON list"      # argparse's "invalid JSON list value: ..." names it so


def _option(default, help: str, **cli):
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class ServerConfig:
    host: str = _option("0.0.0.0", "address to listen on")
    port: int = _option(8000, "port to listen on")
    api_key: str | None = _option(None, "require 'Authorization: Bearer KEY' on /v1 routes (default: env "
                                        "KVFLOW_API_KEY or VLLM_API_KEY)")
    served_model_name: tuple[str, ...] | None = _option(None, "model name(s) the API answers to (default: the "
                                                              "model argument)")
    max_queue_len: int | None = _option(None, "answer 429 when this many sequences are waiting (default: "
                                              "unbounded)")
    max_n: int = _option(DEFAULT_MAX_N, "most sequences one request may ask for (n times its number of prompts)")
    max_request_body_size: int = _option(DEFAULT_MAX_REQUEST_BODY_SIZE, "larger request bodies get 413, e.g. 8MiB",
                                         type=str)
    request_log: str | None = _option(None, "write one JSON line per finished request to PATH ('-' for stdout)",
                                      metavar="PATH")
    request_log_prompts: bool = _option(False, "put each request's prompt (its messages, prompt or input as sent) "
                                               "into its request-log line")
    request_log_max_bytes: int = _option(DEFAULT_REQUEST_LOG_MAX_BYTES, "rotate the request log when it reaches "
                                                                        "this size, e.g. 100MiB (0: never)", type=str)
    request_log_backup_count: int = _option(5, "rotated request logs kept (PATH.1 ... PATH.N)")
    model_version: str | None = _option(None, "the served model's version in the request log and traces (default: "
                                              "sha256 of the model's weight files)")
    otlp_traces_endpoint: str | None = _option(None, "send an OpenTelemetry span per request to this OTLP/HTTP "
                                                     "endpoint, e.g. http://localhost:4318/v1/traces (vLLM's flag; "
                                                     "needs pip install 'kvflow[tracing]')", metavar="URL")
    disable_dashboard: bool = _option(False, "do not serve the live dashboard at /dashboard")
    log_level: str = _option("info", "log level", choices=LOG_LEVELS)
    log_stats_interval: float = _option(5.0, "seconds between stats log lines")
    shutdown_grace_period: float = _option(30.0, "seconds in-flight requests get to finish after SIGTERM")
    enable_auto_tool_choice: bool = _option(False, 'allow tool_choice "auto" (needs --tool-call-parser)')
    tool_call_parser: str | None = _option(None, "how to read the model's own tool calls under tool_choice "
                                                 '"auto": hermes (<tool_call>{...}</tool_call>, Qwen2.5/3), json, '
                                                 "qwen3_coder / qwen3_xml (one format: <tool_call><function=NAME>"
                                                 "<parameter=KEY>...; Qwen3-Coder, Qwen3.5), llama3_json / "
                                                 'llama4_json ({"name": ..., "parameters": ...}; Llama 3.x), '
                                                 "pythonic / llama4_pythonic ([f(a=1), ...]; Llama 3.2 / 4), "
                                                 "mistral ([TOOL_CALLS]...), granite (<|tool_call|>[...]; Granite "
                                                 "3.x) or gemma4 (<|tool_call>call:NAME{...}; Gemma 4)",
                                           choices=tuple(TOOL_PARSERS))
    reasoning_parser: str | None = _option(None, "split the model's reasoning from its answer (message.reasoning, "
                                                 "Responses reasoning items, Messages thinking blocks): deepseek_r1 "
                                                 "or qwen3 (<think>...</think>), granite ('Here is my thought "
                                                 "process:' ... 'Here is my response:')",
                                           choices=REASONING_PARSERS)
    reasoning_budget_message: str | None = _option(None, "text forced before the end-of-thinking marker when a "
                                                         "request's thinking_token_budget is spent (llama-server's "
                                                         "flag)", metavar="TEXT")
    chat_template: str | None = _option(None, "the chat template to render chats with instead of the model's: a "
                                              "file, or the template itself", metavar="TEMPLATE")
    trust_request_chat_template: bool = _option(False, "let a request bring its own chat_template (a template is "
                                                       "code the server runs); off: such a request is a 400")
    return_tokens_as_token_ids: bool = _option(False, "logprobs' tokens as 'token_id:N' unless a request says "
                                                      "otherwise (its return_tokens_as_token_ids)")
    sse_ping_interval: float = _option(30.0, "send an SSE comment (': ping') on a stream that has had nothing to "
                                             "send for this many seconds (a long prefill, a wait in the queue), so "
                                             "clients and proxies see it alive; -1: never (llama-server's flag)",
                                       metavar="SECONDS")
    enable_per_request_metrics: bool = _option(False, "put vLLM's per-request timings (metrics: time_to_first_token_ms, "
                                                      "generation_time_ms, queue_time_ms, mean_itl_ms, "
                                                      "tokens_per_second) into chat and completion responses with one "
                                                      "choice; streamed, on the usage chunk (stream_options."
                                                      "include_usage)")
    enable_server_load_tracking: bool = _option(False, "count the requests in flight on the routes that run the "
                                                       "model, for GET /load (vLLM's; off: it says 0)")
    sleep_idle_seconds: float | None = _option(None, "sleep after this many seconds with no request (llama-server's "
                                                     "flag): the KV cache and the weights are released; the next "
                                                     "request wakes the engine and is answered (default: never)",
                                               metavar="SECONDS")
    enable_tokenizer_info_endpoint: bool = _option(False, "serve GET /tokenizer_info: the tokenizer's configuration "
                                                          "(its tokenizer_config.json and chat template)")
    lora_modules: tuple[str, ...] | None = _option(None, "LoRA adapters to serve from the start (needs --enable-lora): "
                                                         "name=PATH (a PEFT adapter folder), or vLLM's JSON "
                                                         '{"name": ..., "path": ..., "base_model_name": ...}; a request '
                                                         "selects one by its model name", metavar="NAME=PATH")
    # CORS, vLLM's flags (a browser page on another origin calling the API); unlike vLLM's, off unless
    # --allowed-origins is given: no Access-Control-* headers at all
    allowed_origins: tuple[str, ...] | None = _option(None, 'answer CORS requests from these origins, a JSON list, '
                                                            'e.g. \'["http://localhost:3000"]\' or \'["*"]\' (default: '
                                                            "no CORS headers)", type=json_list, metavar="JSON")
    allowed_methods: tuple[str, ...] | None = _option(None, 'CORS: the methods allowed, a JSON list (default with '
                                                            '--allowed-origins: ["*"])', type=json_list, metavar="JSON")
    allowed_headers: tuple[str, ...] | None = _option(None, 'CORS: the request headers allowed, a JSON list (default '
                                                            'with --allowed-origins: ["*"])', type=json_list,
                                                      metavar="JSON")
    allow_credentials: bool = _option(False, "CORS: allow credentials (cookies, Authorization) in cross-origin "
                                             "requests")
    # the online Batch API (server/batches_api.py, server/files_api.py)
    batch_dir: str = _option(DEFAULT_BATCH_DIR, "where the Batch API keeps its SQLite store and files (created on "
                                                "first use; batches found there at start resume)", metavar="DIR")
    max_batch_file_size: int = _option(DEFAULT_MAX_BATCH_FILE_SIZE, "largest file /v1/files accepts (413 above), "
                                                                    "e.g. 200MiB", type=str)
    batch_min_free_space: int = _option(DEFAULT_BATCH_MIN_FREE_SPACE, "refuse an upload or a batch (507) that would "
                                                                      "leave less free disk space in --batch-dir",
                                        type=str)
    batch_max_concurrency: int | None = _option(None, "most batch lines running at once (default: half of "
                                                      "--max-num-seqs, at least 1: the rest stays free for "
                                                      "interactive requests)")
    batch_priority: int = _option(10, "scheduler priority of batch lines (lower runs first; interactive "
                                      "requests: 0)")

    def lora_module_paths(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs (ValueError naming the entry it cannot read)."""
        pairs = []
        for entry in self.lora_modules or ():
            entry = entry.strip()
            if entry.startswith("{"):
                try:
                    spec = json.loads(entry)
                    pairs.append((str(spec["name"]), str(spec["path"])))
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"--lora-modules: cannot read {entry!r}: the JSON form needs \"name\" and "
                                     "\"path\"") from None
                continue
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {entry!r} is not name=PATH")
            pairs.append((name, path))
        return pairs

    def chat_template_text(self) -> str:
        """--chat-template's template: the file's text, or the value itself when it names no file (as vLLM reads
        it: a value without braces or a line break that is no file is a path that does not exist)."""
        path = Path(self.chat_template).expanduser()
        try:
            if path.is_file():
                return path.read_text()
        except OSError:          # a template too long to be a file name
            pass
        if not any(c in self.chat_template for c in "{}\n"):
            raise ValueError(f"--chat-template: no such file {self.chat_template!r}")
        return self.chat_template

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_request_body_size", parse_bytes(self.max_request_body_size))
        object.__setattr__(self, "request_log_max_bytes", parse_bytes(self.request_log_max_bytes))
        object.__setattr__(self, "max_batch_file_size", parse_bytes(self.max_batch_file_size))
        object.__setattr__(self, "batch_min_free_space", parse_bytes(self.batch_min_free_space))
        if self.served_model_name is not None:
            object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        if self.lora_modules is not None:
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
            self.lora_module_paths()
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = json_list(value)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
                if not all(isinstance(v, str) for v in value):
                    raise ValueError(f"--{name.replace('_', '-')} is a JSON list of strings, got {value!r}")
        if self.allowed_origins is None:
            cors = [f"--{n.replace('_', '-')}" for n in ("allowed_methods", "allowed_headers", "allow_credentials")
                    if getattr(self, n)]
            if cors:
                raise ValueError(f"{', '.join(cors)} configure CORS, which --allowed-origins turns on: give it too")
        for name, lo in (("port", 0), ("max_queue_len", 1), ("max_n", 1), ("max_request_body_size", 1),
                         ("shutdown_grace_period", 0), ("max_batch_file_size", 1), ("batch_min_free_space", 0),
                         ("batch_max_concurrency", 1), ("request_log_max_bytes", 0),
                         ("request_log_backup_count", 0)):
            value = getattr(self, name)
            if value is not None and value < lo:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {lo}, got {value}")
        if self.sleep_idle_seconds is not None and not self.sleep_idle_seconds > 0:
            raise ValueError(f"--sleep-idle-seconds must be > 0, got {self.sleep_idle_seconds}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME "
                             f"({', '.join(TOOL_PARSERS)})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.chat_template is not None:
            self.chat_template_text()
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
