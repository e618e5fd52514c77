"""``llmctl serve``: the built-in engine behind an OpenAI-compatible HTTP API, or a
hand-off to vLLM / TensorRT-LLM for scale beyond one box. The work is in
:mod:`llmctl.serve.launch.startup`.

MODEL may also be an engine directory from ``llmctl build-engine`` (ONNX or
torch-compile): the built-in scheduler and API then drive its runtime (see
:mod:`llmctl.engines.serve_engine`)."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import DtypeOpt, KvCacheDtypeOpt, LogLevel

Opt = typer.Option

ServeModelArg = Annotated[
    str,
    typer.Argument(help="HF checkpoint dir, .gguf file, hub id (org/name), 'smollm2-135m', or "
                        "an engine directory from `llmctl build-engine` (onnx / torch-compile: "
                        "its runtime runs under llmctl's scheduler; prefix caching off, "
                        "--dtype ignored, no --draft-model).", show_default=False),
]
Host = Annotated[str, Opt("--host")]
Port = Annotated[int, Opt("--port", min=0, max=65535)]
ServedName = Annotated[str | None, Opt("--served-model-name",
                                       help="Name clients send as `model`.")]
Engine = Annotated[str, Opt("--engine", help="llmctl (built-in) | vllm | trtllm (hand-off).")]
EnginePython = Annotated[str | None, Opt("--engine-python",
                                         help="Python of the venv holding vllm/trtllm.")]
TensorParallel = Annotated[int, Opt("--tensor-parallel-size", min=1,
                                    help="Hand-off engines only.")]
ApiKey = Annotated[str | None, Opt("--api-key", envvar="LLMCTL_API_KEY",
                                   help="Require 'Authorization: Bearer KEY' on every route but /health.")]
AuthFile = Annotated[str | None, Opt(
    "--auth-file", help="YAML of API keys (SHA-256 digests) -> tenants with a priority class "
                        "and limits (requests/tokens per minute, tokens per day, max_tokens); "
                        "reloaded on SIGHUP. Not with --api-key.", show_default=False)]
MaxQueue = Annotated[int, Opt("--max-queue", min=1,
                              help="Waiting requests before 429 + Retry-After (per "
                                   "priority class under --scheduling-policy fair).")]
RequestTimeout = Annotated[float | None, Opt("--request-timeout", min=0.001,
                                             help="Seconds before a request gets 408.")]
GracePeriod = Annotated[float, Opt("--grace-period", min=0.0,
                                   help="Seconds in-flight requests get on SIGTERM.")]
KvCacheMemory = Annotated[str, Opt("--kv-cache-memory",
                                   help="KV budget: '512MiB' or a fraction of free RAM.")]
BlockSize = Annotated[int, Opt("--block-size", min=1)]
MaxModelLen = Annotated[int | None, Opt("--max-model-len", min=1)]
MaxNumSeqs = Annotated[int, Opt("--max-num-seqs", min=1)]
MaxBatchedTokens = Annotated[int, Opt("--max-num-batched-tokens", min=1)]
PrefixCaching = Annotated[bool, Opt("--prefix-caching/--no-prefix-caching")]
ChunkedPrefill = Annotated[bool, Opt("--chunked-prefill/--no-chunked-prefill")]
Speculative = Annotated[Literal["ngram", "draft"] | None,
                        Opt("--speculative", help="ngram | draft (with --draft-model).")]
DraftModel = Annotated[str | None, Opt("--draft-model")]
NumSpecTokens = Annotated[int, Opt("--num-speculative-tokens", min=1)]
Threads = Annotated[int | None, Opt("--threads", min=1,
                                    help="torch threads (engine dirs: runtime threads).")]
LmHead = Annotated[Literal["auto", "int8"], Opt(
    "--lm-head", help="int8: the output projection on int8 codes, a scale per 32 inputs "
                      "(a quarter of fp32's bytes per token); auto: as the checkpoint has it.")]
GGUFWeights = Annotated[Literal["auto", "quantized", "float"], Opt(
    "--gguf-weights", help="A GGUF's Q4_0/Q4_1/Q8_0 tensors: quantized (run as stored) or "
                           "float (dequantized at load). auto: quantized for a .gguf path, "
                           "float for the embedded alias.")]
Bf16Gemm = Annotated[Literal["auto", "own", "onednn"], Opt(
    "--bf16-gemm", help="bf16 dense layers on CPU: own (llmctl's AVX512-BF16 kernel at "
                        "every batch size), onednn, or auto: own without AMX; with AMX "
                        "oneDNN, plus own for 1-4 rows when that copy is <= 1/8 of memory.")]
OtlpTracesEndpoint = Annotated[str | None, Opt(
    "--otlp-traces-endpoint",
    help="Send a span per request (queue, prefill, decode) over OTLP/HTTP to this collector, "
         "e.g. http://localhost:4318/v1/traces; clients' W3C traceparent is honoured. Off by "
         "default. Needs the tracing extra (pip install 'llmctl[tracing]').")]
SchedulingPolicy = Annotated[Literal["fcfs", "fair"], Opt(
    "--scheduling-policy", help="fcfs: lower priority first, then arrival. fair: priority "
                                "classes interactive > standard > batch with aging, and a fair "
                                "share of tokens between tenants of a class.")]
AgingSeconds = Annotated[float, Opt(
    "--aging-seconds", min=0.001, help="fair: a waiting request rises one class per this many "
                                       "seconds (batch reaches interactive in 2x).")]
EngineProcess = Annotated[bool, Opt(
    "--engine-process/--no-engine-process",
    help="Run the engine in supervised processes: a crash or hung step ends its requests "
         "(503, retryable) and the engine restarts; the server stays up. --no-engine-process "
         "keeps it in the API process (debugging; no crash isolation, no --replicas).")]
Replicas = Annotated[int, Opt("--replicas", min=1, help="Engine processes behind one API, the "
                                                        "CPUs split between them; routed by "
                                                        "least outstanding tokens with prefix "
                                                        "affinity.")]
EngineStepTimeout = Annotated[float, Opt(
    "--engine-step-timeout", min=0.001, help="Seconds an engine with requests may go without "
                                             "finishing a step before it is killed and "
                                             "restarted.")]
MaxRss = Annotated[str | None, Opt(
    "--max-rss", help="Resident memory per engine process (e.g. 8GiB) above which it drains "
                      "and restarts.", show_default=False)]
EnableAutoToolChoice = Annotated[bool, Opt(
    "--enable-auto-tool-choice", help='Allow tool_choice "auto" (the default when a chat '
                                      "request has tools): the model calls tools by itself "
                                      "and --tool-call-parser reads the calls (vLLM's flags).")]
ToolCallParser = Annotated[Literal["hermes", "llama3_json", "openai"] | None, Opt(
    "--tool-call-parser", help="The model's tool-call format for tool_choice auto: hermes "
                               "(<tool_call>{...}</tool_call>: Hermes, Qwen2.5), "
                               "llama3_json (a JSON call as the message: Llama 3.1+) or "
                               "openai (gpt-oss's harmony commentary-channel calls; with "
                               "--reasoning-parser harmony).",
    show_default=False)]
ReasoningParser = Annotated[
    Literal["deepseek_r1", "qwen3", "harmony", "openai_gptoss"] | None, Opt(
    "--reasoning-parser", help="Split a reasoning model's thinking (<think>...</think>) from "
                               "its answer: returned as the message's reasoning (and "
                               "reasoning_content), never in content. deepseek_r1: output "
                               "is thinking until </think>; qwen3: only inside <think>; "
                               "harmony (gpt-oss; vLLM's openai_gptoss, accepted too): the "
                               "analysis channel is thinking, the final channel the answer "
                               "(vLLM's flag and names).",
    show_default=False)]
DefaultChatTemplateKwargs = Annotated[str | None, Opt(
    "--default-chat-template-kwargs",
    help="""A JSON object of chat template variables for every chat request, e.g. """
         """'{"enable_thinking": false}'; a request's chat_template_kwargs override it.""",
    show_default=False)]
Pooling = Annotated[Literal["last", "mean"] | None, Opt(
    "--pooling", help="How /v1/embeddings pools the prompt's final hidden states: the last "
                      "token's, or their mean. Default: the model's own (a "
                      "sentence-transformers 1_Pooling config), else last.",
    show_default=False)]
EmbedNormalize = Annotated[bool, Opt(
    "--embed-normalize/--no-embed-normalize",
    help="L2-normalise /v1/embeddings vectors (a request's use_activation overrides).")]
EngineNice = Annotated[int, Opt(
    "--engine-nice", help="CPU niceness of the engine processes (0-19), so the API process "
                          "runs first on shared cores.")]
LoraOpt = Annotated[list[str] | None, Opt(
    "--lora", help="A PEFT LoRA adapter directory as NAME=PATH (repeatable); requests pick "
                   "it with model=NAME and share batches with the base model and other "
                   "adapters.", show_default=False)]
MaxLoras = Annotated[int, Opt("--max-loras", min=1,
                              help="Distinct LoRA adapters running at once (in one batch).")]
MaxLoraRank = Annotated[int, Opt("--max-lora-rank", min=1,
                                 help="Refuse LoRA adapters of a higher rank.")]
EnableLoraRuntimeUpdates = Annotated[bool, Opt(
    "--enable-lora-runtime-updates",
    help="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; "
         "loading reads a server directory the client names).")]
MaxRequestBytes = Annotated[str | None, Opt(
    "--max-request-bytes",
    help="Request bodies larger than this (e.g. 16MiB) get 413 before they are read. "
         "Default: 16 bytes per token x --max-model-len x min(1024 prompts, --max-queue) "
         "+ 1 MiB.", show_default=False)]
MetricsPublic = Annotated[bool, Opt(
    "--metrics-public", help="With --api-key or --auth-file, serve /metrics without a key "
                             "(it names every tenant); otherwise it needs one.")]
AllowSpecialTokensInContent = Annotated[bool, Opt(
    "--allow-special-tokens-in-content",
    help="Chat: text in messages that spells a special token (<|im_end|>) becomes that "
         "token (the old behaviour); by default it stays text, so a user cannot forge "
         "roles or end the turn.")]
ResponsesStoreSize = Annotated[int, Opt(
    "--responses-store-size", min=0,
    help="How many /v1/responses answers to keep in memory (least recently used out) "
         "for previous_response_id and GET /v1/responses/ID; 0 keeps none.")]
LogLevelOpt = Annotated[LogLevel, Opt("--log-level")]


def serve(
    ctx: typer.Context, model: ServeModelArg, host: Host = "127.0.0.1", port: Port = 8000,
    served_model_name: ServedName = None, engine: Engine = "llmctl",
    engine_python: EnginePython = None, tensor_parallel_size: TensorParallel = 1,
    api_key: ApiKey = None, auth_file: AuthFile = None, max_queue: MaxQueue = 256,
    request_timeout: RequestTimeout = None,
    grace_period: GracePeriod = 10.0, dtype: DtypeOpt = "auto",
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    kv_cache_memory: KvCacheMemory = "2GiB", block_size: BlockSize = 16,
    max_model_len: MaxModelLen = None, max_num_seqs: MaxNumSeqs = 64,
    max_num_batched_tokens: MaxBatchedTokens = 512, prefix_caching: PrefixCaching = True,
    chunked_prefill: ChunkedPrefill = True, speculative: Speculative = None,
    draft_model: DraftModel = None, num_speculative_tokens: NumSpecTokens = 4,
    threads: Threads = None, lm_head: LmHead = "auto", gguf_weights: GGUFWeights = "auto",
    bf16_gemm: Bf16Gemm = "auto", otlp_traces_endpoint: OtlpTracesEndpoint = None,
    scheduling_policy: SchedulingPolicy = "fcfs", aging_seconds: AgingSeconds = 30.0,
    engine_process: EngineProcess = True, replicas: Replicas = 1,
    engine_step_timeout: EngineStepTimeout = 60.0, max_rss: MaxRss = None,
    enable_auto_tool_choice: EnableAutoToolChoice = False,
    tool_call_parser: ToolCallParser = None, engine_nice: EngineNice = 10,
    lora: LoraOpt = None, max_loras: MaxLoras = 4, max_lora_rank: MaxLoraRank = 64,
    enable_lora_runtime_updates: EnableLoraRuntimeUpdates = False,
    max_request_bytes: MaxRequestBytes = None, metrics_public: MetricsPublic = False,
    allow_special_tokens_in_content: AllowSpecialTokensInContent = False,
    reasoning_parser: ReasoningParser = None,
    default_chat_template_kwargs: DefaultChatTemplateKwargs = None,
    pooling: Pooling = None, embed_normalize: EmbedNormalize = True,
    responses_store_size: ResponsesStoreSize = 256,
    log_level: LogLevelOpt = "info",
) -> None:
    """Serve a model or a built engine directory over an OpenAI-compatible HTTP API."""
    settings = {k: v for k, v in locals().items() if k != "ctx"}
    settings["lora"] = tuple(lora or ())
    import llmctl.engines  # noqa: F401 - registers engine directories as a model source
    from llmctl.serve.launch.startup import ServeSettings
    from llmctl.serve.launch.startup import serve as run

    given = frozenset(name for name in settings if _given(ctx, name))
    raise typer.Exit(run(ServeSettings(**settings, given=given),
                         say=lambda line: typer.echo(line, err=True)))


def _given(ctx: typer.Context, name: str) -> bool:
    # by name: typer vendors its own click, with its own ParameterSource enum
    source = ctx.get_parameter_source(name)
    return getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT")


def register(app: typer.Typer) -> None:
    app.command()(guarded(serve))
