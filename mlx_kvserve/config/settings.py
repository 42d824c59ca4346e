"""Server settings: every option `serve` takes, with its default and its help.

Every setting has one name. Its environment variable is ``MLX_KVSERVE_<NAME>`` and its key in the
TOML config file is ``<name>``; `mlx-kvserve serve --help` lists them all. Where an effective value
comes from (flags > environment > config file > defaults) is config/precedence.py's job; what a
value may be is config/values.py's; what each setting is read as is config/setting_types.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mlx_kvserve import paths
from mlx_kvserve.config.values import ModelTables, parse_template_kwargs
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.specs import ModelSpec, check_model_tables, merge_specs, parse_model_flag

__all__ = ["ENV_PREFIX", "Settings"]

ENV_PREFIX = "MLX_KVSERVE_"


@dataclass
class Settings:
    """What `serve` needs; the defaults are the safe ones (loopback only, no key)."""

    host: str = field(
        default="127.0.0.1", metadata={"help": "Interface to bind; 0.0.0.0 exposes it."}
    )
    port: int = field(default=8080, metadata={"help": "TCP port (0 picks a free one)."})
    model: list[str] = field(
        default_factory=list,
        metadata={
            "help": "A model to serve, [NAME=]PATH_OR_ID: a local mlx-lm model directory, a "
            "Hugging Face repo id, or an embedded model (default: SmolLM2-135M-Instruct; "
            "gemma3-270m: Gemma 3 270M, Gemma Terms of Use), under NAME if given. Repeat for "
            "several models: the first is the default and loads at start; the others load "
            "when a request names them."
        },
    )
    keep_alive: str = field(
        default="30m",
        metadata={
            "help": "How long a model stays loaded with no request (30s, 5m, 1h; 0 = always); "
            "its conversations stay in the prompt cache and are restored after a reload."
        },
    )
    max_loaded_models: int = field(
        default=3,
        metadata={
            "help": "Models resident at once; loading one more first unloads the least "
            "recently used one that is not pinned, after its requests end."
        },
    )
    memory_budget: str = field(
        default="auto",
        metadata={
            "help": "Memory the loaded models may take together (weights and KV budgets), "
            "e.g. 24GiB; auto = 75%% of the GPU working set on Metal, of RAM on the CPU."
        },
    )
    no_pressure_watch: bool = field(
        default=False,
        metadata={
            "help": "Do not watch the system's memory pressure (by default, under pressure the "
            "prompt cache's RAM tier and resident sessions shrink, then idle models unload)."
        },
    )
    models: ModelTables = field(
        default_factory=list,
        metadata={
            "help": "[[models]] tables: name, model (directory or repo id), aliases, pinned, "
            "keep_alive, settings. --model flags name these by NAME.",
            "file_only": True,
        },
    )
    shard: str = field(
        default="auto",
        metadata={
            "help": "How the model splits across the ranks of an mlx.launch job: tensor (its "
            "heads), pipeline (its layers) or auto (the one the model supports best); "
            "ignored in one process."
        },
    )
    hostfile: str | None = field(
        default=None,
        metadata={
            "help": "Serve one model across the hosts of this mlx.launch hostfile: this "
            "process starts every rank with mlx.launch (rank 0, the first host, serves HTTP), "
            "stops them on SIGTERM and exits with the job's status (75: a rank was lost)."
        },
    )
    ring_port: int = field(
        default=32323,
        metadata={"help": "With --hostfile: the ring backend's first port (rank r: + r)."},
    )
    peer_timeout: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a rank of an mlx.launch job may take to answer before the job "
            "ends with one log line, for the service manager to restart every rank (a forward "
            "pass: this plus 0.25 s for each token it computes)."
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "Require this key ('Authorization: Bearer <key>' or 'x-api-key: <key>') on "
            "every path but /health and the status page's files."
        },
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024, metadata={"help": "Largest request body accepted (413 above)."}
    )
    max_queue: int = field(
        default=16, metadata={"help": "Requests waiting for the engine before 503 + Retry-After."}
    )
    keepalive_seconds: float = field(
        default=5.0, metadata={"help": "SSE keep-alive comment interval while a prefill runs."}
    )
    prefill_step: int = field(
        default=512,
        metadata={"help": "Prompt tokens per prefill chunk (cancellation granularity)."},
    )
    shutdown_grace: float = field(
        default=10.0, metadata={"help": "Seconds in-flight requests get to finish on SIGTERM."}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error."})
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Prompt-cache directory (default: the per-user cache directory)."},
    )
    no_cache: bool = field(
        default=False,
        metadata={"help": "Disable the whole prompt cache (RAM, disk and live reuse)."},
    )
    cache_budget: str | None = field(
        default=None,
        metadata={
            "help": "Disk budget per model, e.g. 20GiB (default: min(20 GiB, 25%% of free "
            "space)); lowered while the disk has less room, and back when space returns."
        },
    )
    cache_ram_budget: str = field(
        default="2GiB", metadata={"help": "RAM budget for cached KV copies, e.g. 512MiB."}
    )
    kv_dtype: str = field(
        default="auto",
        metadata={
            "help": "Activation and KV dtype: auto (float16 on Metal for a model that computes "
            "in float32, else the model's own), native, float32, float16 or bfloat16."
        },
    )
    speculation: str = field(
        default="auto",
        metadata={
            "help": "Speculative decoding: auto (requests, grammars included, draft from their "
            "own prompt and output and the prompt cache's earlier answers, and verify the "
            "drafts in one pass, when it pays; greedy and seeded answers are the same either "
            "way, up to float rounding) or off. Default auto: it drafts nothing where drafting "
            "does not pay, and a request opts out with `speculative: false`. Off in a job "
            "across machines."
        },
    )
    mtp: str = field(
        default="auto",
        metadata={
            "help": "Drafting from the checkpoint's own MTP heads (Qwen3.5/3.6, Qwen3-Next, "
            "DeepSeek-V3, GLM-4.5/4.6) "
            "under --speculation auto: auto (where the checkpoint carries them), on (required: "
            "a checkpoint without them, or --speculation off, is refused at start) or off."
        },
    )
    draft_model: str | None = field(
        default=None,
        metadata={
            "help": "A small model with the same tokenizer (a directory, an org/name repo or an "
            "embedded model's name) that drafts for --speculation auto, batched, beside the "
            "lookup sources. Server-wide only with one model; with several, set it per model "
            "([[models]] settings). Refused at start if its vocabulary differs; not loaded "
            "with --speculation off."
        },
    )
    mlx_cache_limit: str = field(
        default="512MiB",
        metadata={
            "help": "MLX's buffer cache (freed buffers kept for reuse) is bounded by this and "
            "released after long prefills and restores, e.g. 1GiB (0 = keep none)."
        },
    )
    max_concurrency: int = field(
        default=8,
        metadata={
            "help": "Most requests decoding together in one batch (1 = one at a time); fewer "
            "run when their KV would not fit in --kv-budget."
        },
    )
    kv_budget: str = field(
        default="auto",
        metadata={
            "help": "Memory for KV beside the weights, e.g. 4GiB: what the running requests "
            "hold (prompt plus a growth reserve each; the youngest pauses when it runs out), "
            "resident sessions, the RAM tier and queued host copies; auto = half of the memory "
            "left beside the model (docs/memory.md). A prompt that cannot fit alone is a 400."
        },
    )
    kv_reserve: int = field(
        default=256,
        metadata={
            "help": "Tokens of KV a request reserves ahead as it grows (and at admission, "
            "beside its prompt)."
        },
    )
    live_budget: str = field(
        default="1GiB",
        metadata={
            "help": "Live KV of recent conversations kept in MLX memory beside the newest one, so "
            "returning to one restores nothing, e.g. 2GiB (0 = keep only the newest)."
        },
    )
    checkpoint_interval: int = field(
        default=2048,
        metadata={"help": "Checkpoint every N tokens of a long prefill (0 = only at boundaries)."},
    )
    blas_threads: int = field(
        default=0,
        metadata={
            "help": "OpenBLAS threads on the Linux CPU backend (0 = half the cores: idle "
            "OpenBLAS workers spin, so taking every core slows everything else down)."
        },
    )

    served_model_name: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Another name for the served model in /v1/models (repeat the flag or "
            "separate with commas); every name is answered by the loaded model."
        },
    )
    strict_model_names: bool = field(
        default=False,
        metadata={
            "help": "Answer 404 for a model name that is neither the model's id nor a "
            "--served-model-name (by default any name is served by the loaded model)."
        },
    )
    allow_pull: bool = field(
        default=False,
        metadata={
            "help": "Let Ollama's /api/pull download an org/name model from Hugging Face and "
            "serve it beside the others (off: /api/pull only confirms the models served)."
        },
    )

    chat_template_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "Default variables for the model's chat template, a JSON object, e.g. "
            "'{\"enable_thinking\": false}'; a request's own chat_template_kwargs and "
            "reasoning controls win."
        },
    )
    seed: int = field(
        default=-1,
        metadata={
            "help": "Seed of every sampled request that brings none (a request's own `seed` "
            "wins), so the same request gets the same answer; -1: such requests are random."
        },
    )
    thinking_budget: int = field(
        default=0,
        metadata={
            "help": "Most reasoning tokens a thinking model may write before the server ends "
            "its reasoning, when a request sets no budget (0 = no limit)."
        },
    )

    keep_billing_header: bool = field(
        default=False,
        metadata={
            "help": "Keep the per-request 'x-anthropic-billing-header:' line that Claude Code "
            "puts at the start of its system prompt (by default it is dropped: it changes every "
            "request and would force a full re-prefill)."
        },
    )

    images: str = field(
        default="note",
        metadata={
            "help": "What a model that does not see images does with one: note (the image is "
            "replaced in the prompt by a short note of its type and size) or reject (a 400 "
            "naming the model)."
        },
    )
    image_urls: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Hosts whose http(s) image URLs the server may fetch (exact names, "
            "*.example.com, or * for any public host; repeat or comma-separate). Empty: image "
            "URLs are refused, only inline images are taken. Private, loopback and link-local "
            "addresses are refused at every hop."
        },
    )
    image_url_timeout: float = field(
        default=10.0,
        metadata={"help": "Seconds one image URL may take to fetch, its redirects included."},
    )
    max_image_bytes: int = field(
        default=20 * 1024 * 1024, metadata={"help": "Largest image accepted, in encoded bytes."}
    )
    max_image_pixels: int = field(
        default=50_000_000,
        metadata={"help": "Most pixels (width x height) an image may decode to."},
    )

    def template_defaults(self) -> dict[str, JSON]:
        """--chat-template-kwargs as an object (checked when the settings were loaded)."""
        return parse_template_kwargs(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    def cache_root(self) -> Path:
        """--cache-dir / MLX_KVSERVE_CACHE_DIR / config, else the per-user cache directory (created,
        private, only by a writer)."""
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return paths.cache_dir(create=False)

    def model_specs(self) -> list[ModelSpec]:
        """The models to serve, the default first: the --model flags, then the config file's
        [[models]] not named by a flag."""
        tables = check_model_tables(self.models)
        specs = merge_specs([parse_model_flag(m) for m in self.model], tables)
        first = specs[0]  # --served-model-name: more names for the default model
        aliases = tuple(dict.fromkeys([*first.aliases, *self.model_aliases()]))
        specs[0] = ModelSpec(
            first.name, first.source, aliases, first.pinned, first.keep_alive, first.settings
        )
        return specs

    def model_aliases(self) -> list[str]:
        """The --served-model-name values, in order, without blanks or repeats."""
        return list(dict.fromkeys(self.served_model_name))

    # -- security: who may talk to the server, and how much of it one client may hold ----------
    api_keys: list[str] = field(
        default_factory=list,
        metadata={
            "help": "More accepted API keys besides --api-key, one per client (repeat the flag "
            "or separate with commas)."
        },
    )
    isolate_cache: bool = field(
        default=False,
        metadata={
            "help": "Give each API key its own prompt-cache namespace (directory, RAM tier and "
            "live state), so clients sharing the server cannot probe each other's prompts."
        },
    )
    allowed_hosts: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Host header values accepted besides loopback and the bound address "
            "(name or name:port; repeat or comma-separate). Guards against DNS rebinding."
        },
    )
    allowed_origins: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Web origins (scheme://host[:port]) allowed to call the API from a browser; "
            "CORS is answered only for these. Other cross-origin requests get 403."
        },
    )
    insecure_public: bool = field(
        default=False,
        metadata={"help": "Allow binding a non-loopback address without an API key."},
    )
    max_connections: int = field(
        default=1000,
        metadata={
            "help": "Open connections at most (kept below the open-file limit); when full, "
            "the longest-idle connection is closed to make room."
        },
    )
    header_timeout: float = field(
        default=10.0,
        metadata={"help": "Seconds a connection gets to send a request's headers (slowloris)."},
    )
    body_timeout: float = field(
        default=60.0, metadata={"help": "Seconds a client gets to send a request body (408)."}
    )
    idle_timeout: float = field(
        default=5.0, metadata={"help": "Seconds an idle keep-alive connection stays open."}
    )

    @classmethod
    def option_names(cls) -> list[str]:
        """Settings that have a flag and an environment variable (all but the file's tables)."""
        return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("file_only")]
