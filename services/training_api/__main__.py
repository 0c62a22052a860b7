"""`python -m services.training_api --config FILE [--port N]` (= `meshrl serve training`): serve the training API
for the trainer and rollout replicas the recipe names (`trainer.address`, `rollout.servers`)."""

from services.common.rpc.launch import serve_main
from services.training_api.config import TrainingSettings
from services.training_api.servicer import start


async def _start(settings: TrainingSettings, address: str):
    # A recipe that names no trainer or replica is a config problem: one line, not a traceback.
    try:
        return await start(settings, address)
    except ValueError as e:
        raise SystemExit(f"meshrl serve training: {e}") from None


def main(argv=None) -> None:
    serve_main("training", TrainingSettings, _start, argv)


if __name__ == "__main__":
    main()
