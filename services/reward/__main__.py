"""`python -m services.reward --config FILE [--port N]`: run one reward replica."""

from services.common.rpc.launch import serve_main
from services.reward.config import RewardSettings
from services.reward.servicer import start


async def _start(settings: RewardSettings, address: str):
    # A user function that cannot be loaded is a config problem: one line, not a traceback.
    try:
        return await start(settings, address)
    except ValueError as e:
        raise SystemExit(f"meshrl serve reward: {e}") from None


def main(argv=None) -> None:
    serve_main("reward", RewardSettings, _start, argv)


if __name__ == "__main__":
    main()
