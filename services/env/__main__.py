"""`python -m services.env --config FILE [--port N]`: run one env replica (tools and environments)."""

from services.common.rpc.launch import serve_main
from services.env.config import EnvSettings
from services.env.servicer import start


async def _start(settings: EnvSettings, address: str):
    # A user tool or environment that cannot be loaded is a config problem: one line, not a traceback.
    try:
        return await start(settings, address)
    except ValueError as e:
        raise SystemExit(f"meshrl serve env: {e}") from None


def main(argv=None) -> None:
    serve_main("env", EnvSettings, _start, argv)


if __name__ == "__main__":
    main()
