"""What every `meshrl` command shares: the typer app, the one place errors meet the user, the options that reach a
running coordinator. coordinator/cli/__init__.py registers the commands (here, runs.py, manage.py) on this app."""

from __future__ import annotations

import functools
import inspect
import math
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import importlib
import typer
from rich.console import Console
from typer.core import TyperGroup

if TYPE_CHECKING:
    from services.common.rpc.channel import ClientTLS


# The click typer runs on: its own copy in newer typer (typer._click), the click package in older ones.
click_errors = importlib.import_module(typer.BadParameter.__module__)


class OneLineGroup(TyperGroup):
    """The app's group: its usage is `meshrl ...` however it was started, and click's own errors (a missing
    argument, an unknown option, a bad value) end the command with one line `meshrl CMD: ...` on stderr, exit 2,
    as every other error does (`command` below), not click's usage block or typer's boxed panel."""

    def main(self, args=None, prog_name=None, *rest, **kwargs):
        return super().main(args, prog_name or "meshrl", *rest, **kwargs)

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click_errors.ClickException as e:
            raise _one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click_errors.ClickException as e:
            raise _one_line(e) from None


class UsageLine(click_errors.ClickException):
    """A click error as the one line it is shown as."""

    def show(self, file=None) -> None:
        typer.echo(self.message, err=True)


def _one_line(e):
    if isinstance(e, (UsageLine, getattr(click_errors, "NoArgsIsHelpError", UsageLine))):  # prints the help, as asked
        return e
    ctx = getattr(e, "ctx", None)
    path = " ".join(["meshrl", *[c.info_name for c in _chain(ctx)][1:]]) if ctx is not None else "meshrl"
    message = " ".join(e.format_message().split()).rstrip(".")
    if message[:1].isupper() and message[1:2].islower():   # "Missing argument" -> "missing argument"; not "RUN_ID"
        message = message[0].lower() + message[1:]
    out = UsageLine(f"{path}: {message}" + (f" (`{path} --help`)" if isinstance(e, click_errors.UsageError) else ""))
    out.exit_code = e.exit_code
    return out


def _chain(ctx) -> list:
    chain = []
    while ctx is not None:
        chain.insert(0, ctx)
        ctx = ctx.parent
    return chain


# Help is printed as written (rich markup off: `data.train_files=[a.parquet]` keeps its brackets).
app = typer.Typer(cls=OneLineGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="meshrl: RL post-training (PPO, GRPO, RLOO, REINFORCE++, DPO) as a mesh of gRPC services.")
console = Console()

PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}

# gRPC statuses that say the user's input (a config, a run id, a token) is wrong: exit 2, like a config error.
# Any other status (UNAVAILABLE, INTERNAL, DEADLINE_EXCEEDED, ...) is a failure of the system: exit 1.
INPUT_STATUSES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                            "UNAUTHENTICATED", "PERMISSION_DENIED"})
_options = {"debug": False}


@app.callback()
def _global_options(debug: bool = typer.Option(False, "--debug", envvar="MESHRL_DEBUG",
                                               help="print the traceback of an error, not just its line")):
    _options["debug"] = debug


def error_line(e: Exception) -> tuple[str, int]:
    """An error as the one line a user sees, and the exit code: 2 for bad input, 1 for a failure of the system."""
    import grpc

    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        code = e.code().name
        line, exit_code = f"{code}: {e.details() or ''}".rstrip(), 2 if code in INPUT_STATUSES else 1
    elif isinstance(e, ValueError):   # config errors and the checks before anything starts
        line, exit_code = str(e), 2
    elif isinstance(e, RuntimeError):  # a service that died, or did not start (coordinator/cli/launcher.py)
        line, exit_code = str(e), 1
    else:
        line, exit_code = f"{type(e).__name__}: {e} (--debug prints the traceback)", 1
    return " ".join(line.split("\n")), exit_code


class Interrupted(KeyboardInterrupt):
    """A signal handled as Ctrl-C is (`meshrl up` on SIGTERM); the command exits 128 + its number."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def command(name: str | None = None, **kwargs):
    """app.command whose errors end the command with one line `meshrl NAME: ...` on stderr and the exit code
    of error_line; `--debug` prints the traceback first. The one place exceptions meet the user."""
    def register(fn):
        cmd = name or fn.__name__

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            try:
                return fn(*args, **kw)
            except (typer.Exit, typer.Abort, typer.TyperException):  # typer's own: exit codes, usage errors
                raise
            except KeyboardInterrupt as e:   # Ctrl-C, or SIGTERM where a command handles it so (Interrupted)
                typer.echo(f"meshrl {cmd}: interrupted", err=True)
                raise typer.Exit(128 + getattr(e, "signum", 2)) from None
            except Exception as e:  # noqa: BLE001 - every error becomes its line and exit code here
                if _options["debug"]:
                    traceback.print_exc()
                line, exit_code = error_line(e)
                typer.echo(f"meshrl {cmd}: {line}", err=True)
                raise typer.Exit(exit_code) from None
        return app.command(name, **kwargs)(wrapper)
    return register


# The options of every command that calls a running coordinator, with the environment variables the services
# read for the same thing (services/common/config.py ServerConfig: tls_ca, tls_client_cert, ...).
CONNECTION = {
    # None: MESHRL_COORDINATOR, else the running mesh's record (`meshrl mesh`), else 127.0.0.1:50050 (read when the
    # command runs, coordinator/mesh_address.py).
    "coordinator": (Optional[str], typer.Option(None, "--coordinator", show_default=False,
                                                help="coordinator address (default: env MESHRL_COORDINATOR, then "
                                                     "the mesh `meshrl mesh` recorded, then 127.0.0.1:50050)")),
    "token": (Optional[str], typer.Option(None, "--token", envvar="MESHRL_SERVER__AUTH_TOKEN", help="bearer token")),
    "tls_ca": (Optional[str], typer.Option(None, "--tls-ca", envvar="MESHRL_SERVER__TLS_CA",
                                           help="speak TLS, trusting this CA's PEM for the coordinator")),
    "tls_cert": (Optional[str], typer.Option(None, "--tls-cert", envvar="MESHRL_SERVER__TLS_CLIENT_CERT",
                                             help="client certificate PEM (mutual TLS)")),
    "tls_key": (Optional[str], typer.Option(None, "--tls-key", envvar="MESHRL_SERVER__TLS_CLIENT_KEY",
                                            help="client key PEM (mutual TLS)")),
    "tls_server_name": (Optional[str], typer.Option(None, "--tls-server-name",
                                                    envvar="MESHRL_SERVER__TLS_SERVER_NAME",
                                                    help="name in the coordinator's certificate, if not its host")),
}


def client_tls(tls_ca: str | None, tls_cert: str | None, tls_key: str | None, tls_server_name: str | None,
               ctx: typer.Context | None = None):
    """The ClientTLS of the connection options (None: plaintext); a setting that cannot be used is refused by the
    name the user gave it: its flag, or its environment variable when it came from there."""
    from services.common.rpc.channel import ClientTLS, read_pem

    def _source_name(param: str) -> str:
        info = CONNECTION[param][1]
        source = ctx.get_parameter_source(param) if ctx is not None else None
        return info.envvar if source is not None and source.name == "ENVIRONMENT" else info.param_decls[0]

    if bool(tls_cert) != bool(tls_key):
        raise ValueError(f"{_source_name('tls_cert')} and {_source_name('tls_key')}: set both or neither")
    if not tls_ca:
        given = next((p for p, v in (("tls_cert", tls_cert), ("tls_server_name", tls_server_name)) if v), None)
        if given:
            raise ValueError(f"{_source_name(given)}: needs {_source_name('tls_ca')} as well (TLS trusts the CA "
                             f"that signs the coordinator's certificate)")
        return None
    return ClientTLS(read_pem(tls_ca, _source_name("tls_ca")), read_pem(tls_key, _source_name("tls_key")),
                     read_pem(tls_cert, _source_name("tls_cert")), tls_server_name)


@dataclass
class Connection:
    """Where a command's coordinator is and how to reach it (token, TLS)."""

    address: str
    token: str | None = None
    tls: ClientTLS | None = None  # None = plaintext
    # Where the address came from ("--coordinator", "MESHRL_COORDINATOR", the mesh file, the default).
    source: str = ""

    def client(self):
        from coordinator.client import Client

        return Client(self.address, token=self.token, tls=self.tls)


def connects(fn):
    """Gives a command the CONNECTION options; it receives them as one `conn: Connection` keyword."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name not in ("conn", "ctx")]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)
               for name, (kind, info) in CONNECTION.items()]
    params.append(inspect.Parameter("connection_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        opts = {name: kw.pop(name) for name in CONNECTION}
        ctx = kw.pop("connection_ctx")
        tls = client_tls(opts["tls_ca"], opts["tls_cert"], opts["tls_key"], opts["tls_server_name"], ctx)
        if "ctx" in sig.parameters:  # a command that reads its extra words (`meshrl run`'s overrides)
            kw["ctx"] = ctx
        from coordinator.mesh_address import find_coordinator

        found = find_coordinator(opts["coordinator"])
        conn = Connection(found.address, opts["token"], tls, found.source)
        try:
            return fn(*args, **kw, conn=conn)
        except Exception as e:  # noqa: BLE001 - only a coordinator that was never reached is re-worded
            missing = NoCoordinator.of(e, conn.address, conn.source)
            if missing is None:
                raise
            raise missing from e

    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {**{k: v for k, v in fn.__annotations__.items() if k not in ("conn", "ctx")},
                               **{name: kind for name, (kind, _) in CONNECTION.items()},
                               "connection_ctx": typer.Context}
    return wrapper


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def version(weight_version: int) -> str:
    """A replica's weight version as `meshrl services` and `meshrl watch` show it: "-" where none is known (no
    active run has seen the replica since it joined; a reward replica holds no weights)."""
    return str(weight_version) if weight_version >= 0 else "-"


def columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Plain aligned lines, each column as wide as its widest cell: nothing is cut or wrapped at the terminal's
    width (a run id is copied from here into the next command), and `grep`/`awk` read them as they are."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)]


def say(line: str, out: Console | None = None, *, style: str | None = None) -> None:
    """One line printed as it is: no rich markup (`[a.parquet]` stays), no highlighting, never wrapped or cut at
    the terminal's width (run ids and paths are copied from it whole)."""
    (out or console).print(line, style=style, markup=False, highlight=False, soft_wrap=True)


# How grpc words an UNAVAILABLE where no coordinator can be: nothing listens at the address, or its name does not
# resolve. (A refused TLS handshake, a server that closed the connection: a server is there, and its UNAVAILABLE
# keeps its own words.)
UNREACHED = ("Connection refused", "DNS resolution failed", "errors resolving")


class NoCoordinator(RuntimeError):
    """No coordinator answered at the address a command tried: one line naming it and how to start one."""

    @classmethod
    def of(cls, e: Exception, address: str, source: str = "") -> "NoCoordinator | None":
        """The error as NoCoordinator when it says nothing listens at the address or its name does not resolve,
        else None: any other UNAVAILABLE (one the coordinator answered, a TLS mismatch) keeps its message."""
        import grpc

        if not (isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None))
                and e.code() == grpc.StatusCode.UNAVAILABLE):
            return None
        details = e.details() or ""
        if not any(words in details for words in UNREACHED):
            return None
        cause = details.rsplit(": ", 1)[-1].strip(" []") or "UNAVAILABLE"
        looked = f" (the address: {source})" if source else ""
        return cls(f"no coordinator at {address} ({cause}); start a mesh with `meshrl mesh RECIPE` or `meshrl up RECIPE` "
                   f"(README), or name the coordinator with --coordinator HOST:PORT or MESHRL_COORDINATOR{looked}")


class LostCoordinator(RuntimeError):
    """The coordinator went away after the command reached it (killed, or its mesh stopped with its trainer) while
    it followed a run: one line naming the run and how to find it again, not `no coordinator at ...` (NoCoordinator)
    nor grpc's own words (`Stream removed (Socket closed)`, `Cancelling all calls`)."""

    @classmethod
    def of(cls, e: Exception, address: str, run_id: str) -> "LostCoordinator | None":
        import grpc

        if not (isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None))
                and e.code() == grpc.StatusCode.UNAVAILABLE):
            return None
        cause = e.details() or "UNAVAILABLE"
        return cls(f"lost the coordinator at {address} while following run {run_id} ({cause}); "
                   f"with a run store (run.redis_url) the run is kept: once a coordinator on that store serves again "
                   f"(start the mesh again), `meshrl status` shows it, an interrupted run goes on by itself and "
                   f"`meshrl resume {run_id}` continues a PAUSED one; without a run store the run is gone")
