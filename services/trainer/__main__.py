"""`python -m services.trainer --config FILE [--port N]`, also under `torchrun --nproc_per_node=K -m services.trainer`.

Rank 0 serves gRPC; every other rank builds the same engine and runs the commands rank 0 broadcasts.
"""

import os

from services.common.config import load_config
from services.common.rpc.launch import parse_args, serve_main
from services.common.rpc.server import setup_logging
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.parallel.mesh import launched_rank
from services.trainer.servicer import start


def worker_main(argv=None) -> None:
    """Ranks > 0: no server, just the SPMD loop."""
    args, overrides = parse_args("trainer", argv)
    setup_logging(os.environ.get("MESHRL_LOG_LEVEL", "INFO"))
    try:
        settings = load_config(TrainerSettings, args.config, overrides=overrides)
    except ValueError as e:
        raise SystemExit(f"meshrl serve trainer: {e}") from None
    engine = TrainerEngine(settings)
    engine.serve_workers()
    import torch.distributed as dist

    dist.destroy_process_group()


def main(argv=None) -> None:
    if launched_rank() != 0:
        worker_main(argv)
    else:
        serve_main("trainer", TrainerSettings, start, argv)


if __name__ == "__main__":
    main()
