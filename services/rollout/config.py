"""Settings of a rollout replica: the `rollout:` section and the replica's whole settings file."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from services.common.auto import AUTO, Auto
from services.common.config import MeshSettings, ModelConfig, PoolConfig, Section, ServerConfig, bool_choice
from services.common.rpc.registry import RegistryRunSection
from services.common.tool_calls import TOOL_CALL_PARSERS
from services.env.config import EnvConfig
from services.rollout.types import AgentLimits, SamplingParams


# The engine class of each `rollout.engine` name, as a dotted path that services/rollout/engines.py imports only
# when a replica starts with that engine (so vLLM loads only where chosen, and a client of these settings loads
# none). A new engine is its own folder (engine_<name>/engine.py) and one line here.
ENGINES: dict[str, str] = {
    "torch": "services.rollout.engine_torch.engine:TorchEngine",
    "vllm": "services.rollout.engine_vllm.engine:VLLMEngine",
    "openai": "services.rollout.engine_openai.engine:OpenAIEngine",
}


# rollout.max_batch_size auto, by whether the torch engine decodes with CUDA graphs
# (services/rollout/engine_torch/speed.py).
AUTO_MAX_BATCH_SIZE = {True: 512, False: 64}
# The paged KV pool's auto size on CUDA (rollout.kv_cache_gib unset) is room for max_batch_size rows of this many
# prompt tokens plus twice rollout.max_tokens (what the unpaged graph decoder's cache takes for a full batch of such
# prompts with continuous batching), at most max_model_len a row, and at most half the CUDA memory free at start.
AUTO_KV_PROMPT_TOKENS = 256


def auto_kv_pool_tokens(max_batch_size: int, max_tokens: int, max_model_len: int | None) -> int:
    """Tokens the paged KV pool holds under auto on CUDA (before the cap by free memory)."""
    per_row = AUTO_KV_PROMPT_TOKENS + 2 * max_tokens
    return max_batch_size * (per_row if max_model_len is None else min(per_row, max_model_len))


# Agent loops by name (`rollout.agent.name`, a data row's verl `agent_name`): the loops themselves are
# services.rollout.agents.episodes.AGENT_LOOPS; verl's names are aliases of meshrl's.
AGENT_NAMES = ("single_turn", "tool_agent", "env_agent", "openai_agent")
AGENT_ALIASES = {"single_turn_agent": "single_turn"}


class AgentConfig(Section):
    """`rollout.agent:` multi-turn episodes played in the rollout replica (GenerateEpisodes, docs/agentic.md)."""

    # A name of AGENT_NAMES (or a verl alias); None = single-turn Generate as before (a data row's `agent_name`
    # still picks a loop for its prompt).
    name: str | None = None
    # Model turns per episode at most (end_reason max_turns).
    max_turns: int = Field(4, ge=1, le=256)
    # Response tokens per episode at most, sampled + observation (end_reason length); cut to fit the model.
    max_total_tokens: int = Field(2048, ge=1)
    # New tokens per model turn; None = rollout.max_tokens.
    max_tokens_per_turn: int | None = Field(None, ge=1)
    # Tools offered to the model, by name, as the env replicas host them (ListTools); [] = every hosted tool.
    tools: list[str] = Field(default_factory=list)
    # How tool calls are read from the model's text: a name of TOOL_CALL_PARSERS or `package.module:function`;
    # None = env.tool_call_parser.
    tool_call_parser: str | None = None
    # A failed tool call: observe (the model reads the error as the tool's answer and goes on) or end (the
    # episode ends with end_reason tool_error).
    tool_error_policy: Literal["observe", "end"] = "observe"
    # env_agent: the environment (a name the env replicas know: a built-in or env.environments) each episode resets.
    environment: str | None = None
    # env_agent: the environment's state is a function of its reset kwargs and the actions, so an episode whose env
    # replica is lost is reset on another one and its actions replayed; false ends it with end_reason env_lost.
    environment_deterministic: bool = True
    # openai_agent: the agent program as `package.module:function`.
    program: str | None = None

    @field_validator("name")
    @classmethod
    def _known_agent(cls, v: str | None) -> str | None:
        if v is not None and AGENT_ALIASES.get(v, v) not in AGENT_NAMES:
            raise ValueError(f"unknown agent loop {v!r} (known: {', '.join(AGENT_NAMES)})")
        return v

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, v: str | None) -> str | None:
        if v is not None and v not in TOOL_CALL_PARSERS and ":" not in v:
            raise ValueError(f"unknown parser {v!r} (built-ins: {', '.join(TOOL_CALL_PARSERS)}; "
                             f"or 'package.module:function')")
        return v

    def limits(self, max_tokens: int) -> AgentLimits:
        """The per-episode limits; `max_tokens` (rollout.max_tokens) is the per-turn default."""
        return AgentLimits(max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                           max_tokens_per_turn=self.max_tokens_per_turn or max_tokens,
                           tool_error_policy=self.tool_error_policy)


class RolloutConfig(PoolConfig):
    """`rollout:` section: the engine and the default sampling settings of a replica."""

    engine: str = "torch"              # a name in ENGINES
    # Defaults for requests that leave a sampling field unset (0 / empty in the proto), and a run's sampling:
    # a group of 8 per prompt (GRPO and RLOO need >= 2) and verl's max_response_length, 512.
    n: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(512, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    # Rows (prompts x samples) decoded together; larger requests run in several chunks. auto: 512 on the
    # torch engine's CUDA-graph path (the KV cache follows the rows a batch has, not this cap), 64 elsewhere
    # (AUTO_MAX_BATCH_SIZE).
    max_batch_size: Annotated[int, Field(ge=1)] | Auto = AUTO
    # Prompt + response token limit; None = the model's max_position_embeddings.
    max_model_len: int | None = Field(None, ge=2)
    # Micro-batch token budget of ComputeLogProbs.
    logprobs_token_budget: int = Field(16384, ge=1)
    # OpenAI-compatible HTTP API port (0 = any free port); None = no HTTP API.
    http_port: int | None = Field(None, ge=0, le=65535)
    # engine "openai": base URL of the OpenAI-compatible server to proxy (http://host:port/v1).
    server_url: str | None = None
    # Model name the HTTP API answers to; None = model.path.
    served_model_name: str | None = None
    # engine "openai": model name requested upstream; None = the first one the server's /v1/models lists.
    upstream_model: str | None = None
    # engine "openai": seconds per upstream request, retries of failed ones, and the bearer token
    # the upstream needs (env MESHRL_ROLLOUT__API_KEY).
    request_timeout_s: float = Field(600.0, gt=0)
    request_retries: int = Field(2, ge=0)
    api_key: SecretStr | None = None
    # engine "openai": ask for token ids with vLLM's return_token_ids / return_tokens_as_token_ids
    # (turn off for servers that reject unknown fields; the local tokenizer then maps tokens to ids).
    request_token_ids: bool = True
    # engine "openai": the API each prompt goes to: completions (/v1/completions, prompt ids or text) or chat
    # (/v1/chat/completions, the prompt text as a user message; the server applies its chat template).
    openai_api: Literal["completions", "chat"] = "completions"
    # engine "openai": a folder the upstream server reads; each weight update lands there as safetensors and the
    # server reloads it through vLLM's weight-update HTTP endpoints (vllm serve with VLLM_SERVER_DEV_MODE=1).
    # None: the upstream keeps its weights, and on-policy runs refuse this replica before step 1.
    weights_dir: str | None = None
    # Serve those weight-update endpoints on this replica's HTTP API too (/pause, /resume, /is_paused,
    # /collective_rpc reload_weights, /update_weight_version, /weight_info), so an `openai` replica can
    # proxy it and train. Off by default: reload_weights reads a path the caller names.
    http_weight_updates: bool = False
    # engine "vllm": share of accelerator memory vLLM takes for weights + KV cache; None = 0.9. On CPU it is
    # the share of RAM given to the KV cache alone (None = 0.1), passed to vLLM as an explicit size: vLLM's own
    # CPU reading subtracts the worker's resident memory from the share, which fails on small hosts.
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # KV cache size in GiB. engine "vllm": overrides gpu_memory_utilization's share for the cache (on CPU the
    # environment variable VLLM_CPU_KVCACHE_SPACE, in GiB, overrides both). engine "torch" with kv_cache paged: the
    # block pool's size; None = on CUDA room for max_batch_size rows of 256 prompt tokens + 2 x max_tokens (at most
    # max_model_len a row), at most half the CUDA memory free after the model loads; on CPU 256 max_model_len rows,
    # at most 10% of RAM.
    kv_cache_gib: float | None = Field(None, gt=0)
    # engine "torch": the KV cache. paged: fixed-size blocks, block tables, a prefix cache across calls (a GRPO
    # group's prompt prefilled once, an episode's next turn feeds only its new tokens), admission and preemption by
    # the kv_cache_gib budget (services/rollout/engine_torch/paged/; CUDA graphs with kv_cache_cuda_graphs). Serves LoRA
    # adapters (enable_lora): its prefix cache, forks and pins are keyed by adapter name and version as well as by
    # tokens. none: each decode builds its own left-padded cache. auto: paged where its CUDA-graph step runs (CUDA,
    # Triton, a model the graph decoders support, power-of-two kv_block_size and head_dim), none elsewhere (CPU).
    kv_cache: Literal["paged", "none"] | Auto = AUTO
    # kv_cache paged: tokens per KV block.
    kv_block_size: int = Field(16, ge=1, le=1024)
    # kv_cache paged on CUDA: each decode step's forward is a captured CUDA graph per batch bucket
    # (services/rollout/engine_torch/paged/graphs.py). auto: on with CUDA, Triton and power-of-two kv_block_size and
    # head_dim (the Triton paged kernel), where it decodes 3-6x the eager paged steps (bench/results/paged_kv_gpu.json).
    kv_cache_cuda_graphs: bool | Auto = AUTO
    # engine "vllm": more vllm.AsyncEngineArgs ({tensor_parallel_size: 2, enforce_eager: false, ...}); they
    # override the ones meshrl sets.
    vllm_engine_args: dict[str, Any] = Field(default_factory=dict)
    # engine "torch" on CUDA: decode with one captured CUDA graph per step over a static KV cache
    # (services/rollout/engine_torch/cuda_decode.py), seeded rows, stop strings and top-logprobs included; only
    # seeded rows in a batch that needs top-p (or without Triton) use the eager loop. auto: on for the torch engine
    # on a CUDA device whose model the graph decoder supports (Qwen2, Llama), off elsewhere; true where it cannot
    # work is refused when the replica starts.
    cuda_graphs: bool | Auto = AUTO
    # With cuda_graphs or kv_cache_cuda_graphs: torch.compile the decode step's layers first (fewer, fused kernels;
    # compiled during the replica's warm-up). auto: on where Triton runs (inductor's GPU backend), off elsewhere.
    cuda_graph_compile: bool | Auto = AUTO
    # Warm up before serving (the replica reports SERVING after it): with cuda_graphs, compile the decode step and
    # capture graphs on a small batch at rollout.max_tokens, so a run's first step costs what later ones do.
    warmup: bool = True
    # With cuda_graphs (and the paged KV cache's steps): sample (temperature / greedy, not top-p) with one fused
    # Triton kernel per step (services/rollout/engine_torch/fused_sample.py) instead of torch ops over fp32 copies of
    # the logits.
    cuda_graph_fused_sampler: bool = True
    # With cuda_graphs: attention over each row's filled cache slots only, in one Triton kernel per layer
    # (services/rollout/engine_torch/decode_attention.py), instead of torch ops over the whole length bucket.
    cuda_graph_triton_attention: bool = True
    # With cuda_graphs: requests that arrive while a graph decode runs join it in the batch rows of ended rows, and
    # each request is answered as soon as its rows ended (services/rollout/engine_torch/continuous.py; unseeded
    # requests without stop strings). The KV cache then has room for joiners: prompt + twice the longest budget per row.
    continuous_batching: bool = True
    # A run's partial rollouts (run.async_mode): a weight update lands between two decode steps of the batches in
    # flight instead of waiting for them to end, each token tagged with its version: `continue` goes on over the
    # KV cache the old weights computed, `pause` recomputes the running rows' KV cache with the new weights first
    # (eager decode loop); `off` waits. Sent with each Generate of the run's training batches; the torch engine
    # honours it (docs/async.md).
    partial_rollouts: Literal["off", "continue", "pause"] = "off"
    # YAML reads a bare `off` as false.
    _partial_off = field_validator("partial_rollouts", mode="before")(bool_choice(None, "off"))
    # Multi-turn episodes (GenerateEpisodes): the agent loop and its limits.
    agent: AgentConfig = AgentConfig()
    # engine "torch": serve LoRA adapters over the frozen base, unmerged (services/rollout/engine_torch/lora.py):
    # weight pushes of a LoRA run then carry the adapter alone, and one batch holds rows of several adapters
    # (sampling.adapter). auto: on when the recipe trains adapters (actor.lora), off elsewhere. vLLM's names.
    enable_lora: bool | Auto = AUTO
    # Adapters served at once, and their largest rank (auto: actor.lora.rank, else 16): the stacked adapter
    # buffers are sized by both when the replica starts (CUDA graphs read them by address).
    max_loras: int = Field(4, ge=1, le=64)
    max_lora_rank: Annotated[int, Field(ge=1, le=512)] | Auto = AUTO
    # Linear layers (last part of the module path) adapters may target; None = actor.lora.target_modules, else
    # every projection of a decoder layer.
    lora_target_modules: list[str] | None = None

    @model_validator(mode="after")
    def _lora_needs_an_adapter_engine(self):
        if self.enable_lora is True and self.engine == "openai":
            raise ValueError("enable_lora: true, but the openai engine proxies a server whose adapters meshrl does not "
                             "load; set it to auto or false (the replica then takes merged weights)")
        return self

    @model_validator(mode="after")
    def _graphs_need_torch(self):
        if self.cuda_graphs is True and self.engine != "torch":
            raise ValueError(f"cuda_graphs: true needs engine 'torch' (the {self.engine} engine decodes its own way); "
                             "set it to auto or false")
        return self

    @model_validator(mode="after")
    def _paged_needs_torch(self):
        if self.kv_cache_cuda_graphs is True and self.kv_cache != "paged":
            raise ValueError("kv_cache_cuda_graphs: true needs kv_cache: paged (today's cache has its own graphs: "
                             "cuda_graphs)")
        if self.kv_cache == "paged" and self.engine != "torch":
            raise ValueError(f"kv_cache: paged needs engine 'torch' (the {self.engine} engine keeps its own cache); "
                             "set it to auto or none")
        return self

    @model_validator(mode="after")
    def _partial_needs_torch(self):
        if self.partial_rollouts != "off" and self.engine != "torch":
            raise ValueError(f"partial_rollouts: {self.partial_rollouts!r} needs engine 'torch' (the {self.engine} "
                             "engine swaps weights between generations only); set partial_rollouts: off")
        return self

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"must be one of {', '.join(map(repr, ENGINES))}, got {v!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    def sampling(self, **overrides: Any) -> SamplingParams:
        """The default sampling settings of this section as SamplingParams; `overrides` replace fields by name
        (a client's per-step seed, greedy evaluation: `sampling(n=1, temperature=0.0)`)."""
        defaults = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                        stop=list(self.stop), seed=self.seed)
        return SamplingParams(**{**defaults, **overrides})


class ActorLoraHint(BaseModel):
    """What a replica reads of the recipe's `actor:` section: whether (and how) the run trains adapters, so
    rollout.enable_lora auto follows it. Every other actor key is the trainer's."""

    model_config = ConfigDict(extra="ignore")

    lora: dict[str, Any] | None = None


class RolloutSettings(MeshSettings):
    """A replica's settings file: the model it serves, its `rollout:` section and its gRPC server."""

    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    server: ServerConfig = ServerConfig()
    # The env replicas the episode loop calls (the recipe's top-level `env:` section; its pool keys servers, dns,
    # registry, load_balancer, timeout_s, rejoin_wait_s are what the replica reads).
    env: EnvConfig = EnvConfig()
    # run.redis_prefix: the registry keys env replicas register under (with env.registry).
    run: RegistryRunSection = RegistryRunSection()
    # The recipe's actor.lora, read for rollout.enable_lora / max_lora_rank / lora_target_modules auto.
    actor: ActorLoraHint = ActorLoraHint()
