"""`python -m coordinator --config FILE [--port N]`: run the coordinator (run API)."""

from coordinator.runapi.service import CoordinatorSettings, start
from services.common.rpc.launch import serve_main


def main(argv=None) -> None:
    serve_main("coordinator", CoordinatorSettings, start, argv)


if __name__ == "__main__":
    main()
