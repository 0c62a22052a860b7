"""`python -m services.reference --config FILE [--port N]`: run one reference replica."""

from services.common.rpc.launch import serve_main
from services.reference.config import ReferenceSettings
from services.reference.servicer import start


def main(argv=None) -> None:
    serve_main("reference", ReferenceSettings, start, argv)


if __name__ == "__main__":
    main()
