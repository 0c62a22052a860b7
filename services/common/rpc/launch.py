"""The one entry point every service process goes through: config, logging, serve, announce, drain."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any, Awaitable, Callable, Sequence

import yaml

from services.common.config import MeshSettings, load_config
from services.common.rpc.server import MeshServer, announce, serve_until_signalled, setup_logging

# start(settings, address) -> (server, port, engine-or-None); the engine may expose `async close()`.
log = logging.getLogger("meshrl.launch")

StartFn = Callable[[Any, str], Awaitable[tuple[MeshServer, int, Any]]]


def parse_args(role: str, argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(prog=f"meshrl serve {role}")
    parser.add_argument("--config", help="YAML config file (all sections of a run)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (0 = any free port)")
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    args, rest = parser.parse_known_args(argv)
    return args, parse_dotted_flags(rest)


def parse_dotted_flags(rest: Sequence[str]) -> dict[str, Any]:
    """`--rollout.n 4` or `--rollout.n=4` -> {'rollout.n': '4'} (pydantic coerces the type); a list or a mapping is
    written as YAML writes one inline: `--data.train_files [a.jsonl,b.jsonl]`, `--rollout.stop '["###"]'`."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg:
            raise SystemExit(f"unknown argument {arg!r} (overrides look like --section.key value)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(rest):
                raise SystemExit(f"{arg}: missing value")
            key, value = arg[2:], rest[i + 1]
            i += 2
        overrides[key] = _flag_value(key, value)
    return overrides


def _flag_value(key: str, value: str) -> Any:
    """A flag's value as it was given, or the list or mapping it writes in YAML's inline form (`[a, b]`, `{k: v}`):
    a list key (data.train_files, rollout.stop, actor.betas, ...) takes a flag as it takes a YAML value. A value
    that is no such YAML stays the string given (`[::1]:50051`, an address)."""
    if not value.startswith(("[", "{")):
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, (list, dict)) else value


def serve_main(role: str, settings_cls: type[MeshSettings], start: StartFn, argv: Sequence[str] | None = None,
               host_for_announce: str | None = None) -> None:
    args, overrides = parse_args(role, argv)
    if args.port is not None:
        overrides["server.port"] = str(args.port)
    if args.host is not None:
        overrides["server.host"] = args.host
    setup_logging(os.environ.get("MESHRL_LOG_LEVEL", "INFO"))
    try:
        settings = load_config(settings_cls, args.config, overrides=overrides)
    except ValueError as e:
        # One line and exit code 2, as every `meshrl` command reports bad input (docs/coordinator.md).
        print(f"meshrl serve {role}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    prefix = _registry_prefix(role, args.config, overrides) if settings.server.registry_url else ""
    asyncio.run(_serve(role, settings, start, host_for_announce, prefix))


def _registry_prefix(role: str, config: str | None, overrides: dict[str, str]) -> str:
    """`run.redis_prefix` as the coordinator reads it (YAML < env < flags): the registry keys go under it."""
    from services.common.rpc.registry import RegistrySettings

    try:
        return load_config(RegistrySettings, config, overrides=overrides).run.redis_prefix
    except ValueError as e:
        print(f"meshrl serve {role}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


async def _serve(role: str, settings: Any, start: StartFn, host_for_announce: str | None,
                 registry_prefix: str) -> None:
    server_cfg = settings.server
    mesh, port, engine = await start(settings, f"{server_cfg.host}:{server_cfg.port}")
    announce(role, host_for_announce or server_cfg.host, port)

    async def close():
        closer = getattr(engine, "close", None)
        if closer is not None:
            result = closer()
            if asyncio.iscoroutine(result):
                await result

    heartbeat = None
    stop_heartbeat = asyncio.Event()
    if server_cfg.registry_url:
        from services.common.rpc.registry import Registry

        registry = Registry(server_cfg.registry_url, prefix=registry_prefix)
        advertised = f"{advertise_host(server_cfg)}:{port}"
        heartbeat = asyncio.create_task(registry.heartbeat(role, advertised, stop_heartbeat))
        log.info("registered %s %s in the service registry (keys under %r)", role, advertised, registry_prefix)

    async def leave():
        # Leave the registry first so the coordinator stops routing here while calls drain.
        stop_heartbeat.set()
        if heartbeat is not None:
            await heartbeat

    await serve_until_signalled(mesh, grace=server_cfg.grace_seconds, on_stop=leave)
    await close()


def advertise_host(server_cfg) -> str:
    if server_cfg.advertise_host:
        return server_cfg.advertise_host
    if server_cfg.host in ("0.0.0.0", "::", "[::]"):
        return socket.gethostname()
    return server_cfg.host
