"""`python -m services.reward --config FILE [--port N]`: run one reward replica."""


def main(argv=None) -> None:
    # Imported here, not at the top: user-function workers are spawned processes that re-import this
    # module as __mp_main__, and they should not pay for grpc (or torch) imports they never use.
    from services.common.launch import serve_main
    from services.reward.engine import RewardSettings
    from services.reward.servicer import start

    serve_main("reward", RewardSettings, start, argv)


if __name__ == "__main__":
    main()
