"""`python -m services.rollout --config FILE [--port N]`: run one rollout replica."""

from services.common.rpc.launch import serve_main
from services.rollout.config import RolloutSettings
from services.rollout.servicer import start


def main(argv=None) -> None:
    serve_main("rollout", RolloutSettings, start, argv)


if __name__ == "__main__":
    main()
