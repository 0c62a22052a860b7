"""Settings of the env service: the `env:` section, its tools and environments, and the registries of built-ins.

This is the env face: a client (the coordinator, the episode loop) loads it to read a run's `env:` section; it
imports no tool implementation (the registries name them as `module:Class` strings, loaded by the engine).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.common.config import MeshSettings, PoolConfig, Section, ServerConfig
from services.common.tool_calls import TOOL_CALL_PARSERS

# Built-in tools by name -> the class that implements it (one file per tool; one line to register a new one).
TOOLS: dict[str, str] = {
    "calculator": "services.env.calculator:Calculator",
    "python": "services.env.sandbox:PythonTool",
}
# Built-in text environments by name -> class; user ones come in as `package.module:Class` in env.environments.
ENVIRONMENTS: dict[str, str] = {
    "guess_number": "services.env.environments:GuessNumber",
}


class UserToolConfig(Section):
    """`env.tools[i]`: a user tool, `fn(**arguments) -> str` (sync or async), described by a JSON schema."""

    name: str = Field(min_length=1)
    # `package.module:function` or `path/to/file.py:function`.
    function: str
    description: str = ""
    # JSON schema of the arguments object; the arguments a model gives are validated against it.
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    # Seconds one call may take (default: env.tool_timeout_s).
    timeout_s: float | None = Field(None, gt=0)


class PythonToolConfig(Section):
    """`env.python`: limits of the sandboxed `python` tool (each call is a fresh process)."""

    # Wall seconds before the whole process group (and PID namespace) is killed.
    timeout_s: float = Field(10.0, gt=0)
    # CPU seconds (RLIMIT_CPU) per process.
    cpu_s: int = Field(5, ge=1)
    # Address space per process (RLIMIT_AS), MiB.
    memory_mb: int = Field(1024, ge=64)
    # Bytes of stdout and of stderr kept; more is cut and the process killed.
    max_output_bytes: int = Field(16384, ge=256)
    # Processes the sandbox user may run (RLIMIT_NPROC; applied where the sandbox runs as its own user).
    max_processes: int = Field(32, ge=1)
    # Largest file the code may write (RLIMIT_FSIZE), MiB.
    max_file_mb: int = Field(16, ge=0)
    # auto: a network namespace when the kernel allows one (root, or unprivileged user namespaces), else the
    # socket module is disabled inside the process (best effort, said in GetInfo); namespace: refuse to start
    # without a namespace.
    network: Literal["auto", "namespace"] = "auto"


class EnvConfig(PoolConfig):
    """`env:` section."""

    # Built-in tools this replica hosts (names of TOOLS).
    builtin_tools: list[str] = Field(default_factory=lambda: ["calculator", "python"])
    python: PythonToolConfig = PythonToolConfig()
    tools: list[UserToolConfig] = Field(default_factory=list)
    # Seconds a user tool call may take before it fails with an error observation.
    tool_timeout_s: float = Field(30.0, gt=0)
    # Tool calls run at once on this replica (more wait).
    max_concurrency: int = Field(8, ge=1)
    # Environments by name -> `package.module:Class` (added to the built-ins, ENVIRONMENTS).
    environments: dict[str, str] = Field(default_factory=dict)
    # Live episodes this replica holds at most; a Reset past it is RESOURCE_EXHAUSTED.
    max_episodes: int = Field(4096, ge=1)
    # An episode untouched this long is dropped (its caller died without EndEpisode).
    episode_ttl_s: float = Field(3600.0, gt=0)
    # How tool calls are read from model text: a name of services.common.tool_calls.TOOL_CALL_PARSERS or
    # `package.module:function` (read by the episode loop and the rollout HTTP API, not by this service).
    tool_call_parser: str = "hermes"

    @field_validator("builtin_tools")
    @classmethod
    def _known_tools(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in TOOLS:
                raise ValueError(f"unknown tool {name!r} (built-ins: {', '.join(TOOLS)})")
        return v

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, v: str) -> str:
        if v not in TOOL_CALL_PARSERS and ":" not in v:
            raise ValueError(f"unknown parser {v!r} (built-ins: {', '.join(TOOL_CALL_PARSERS)}; "
                             f"or 'package.module:function')")
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> "EnvConfig":
        seen = set(self.builtin_tools)
        for i, tool in enumerate(self.tools):
            if tool.name in seen:
                raise ValueError(f"env.tools[{i}].name: {tool.name!r} is already a tool of this replica")
            seen.add(tool.name)
        for name, path in self.environments.items():
            if ":" not in path:
                raise ValueError(f"env.environments.{name}: {path!r} is not 'package.module:Class'")
        return self


class EnvSettings(MeshSettings):
    env: EnvConfig = EnvConfig()
    server: ServerConfig = ServerConfig()
