"""Builds a random-weight Qwen2.5-shaped model folder for examples/gpu/grpo.yaml (no hub needed).

    python examples/gpu/make_model.py --shape qwen2.5-1.5b [--out DIR] [--dtype bfloat16]

The weights are random (seed 0) in the real Qwen2.5 shapes (bench/peers/settings.py QWEN25), with the
arithmetic task's character tokenizer beside them (its ids are a subset of the shape's vocabulary), so a run
measures the memory and speed of that size, not its accuracy. Any Hugging Face folder works in model.path
in place of this one.

Runs on CPU. The model is initialised straight in --dtype: host memory is about the folder's size
(2 bytes per parameter in bf16: 1 GB at 0.5B, 3 GB at 1.5B, 6 GB at 3B, 15 GB at 7B), and the random
init takes from seconds (0.5B) to a few minutes (7B) on a few cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.peers.settings import QWEN25, make_random_model  # noqa: E402

MODELS_DIR = REPO / "examples" / "gpu" / "models"


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(QWEN25), help="Qwen2.5 shape to build")
    p.add_argument("--out", type=Path, default=None,
                   help="model folder (default: examples/gpu/models/<shape>, git-ignored)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--force", action="store_true", help="build again over an existing folder")
    p.add_argument("--device", default=None,
                   help="where the weights are drawn (default: cuda when there is one, else cpu; seconds vs minutes)")
    args = p.parse_args(argv)
    out = args.out or MODELS_DIR / args.shape
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")) and not args.force:
        print(f"{out} already holds a model (--force builds it again)")
        return out
    start = time.perf_counter()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    make_random_model(out, dtype=args.dtype, shape=QWEN25[args.shape], init_in_dtype=True, device=device)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30
    print(f"{args.shape} ({args.dtype}, random weights, seed 0, drawn on {device}) in {out}: {size:.2f} GiB of weights, "
          f"{time.perf_counter() - start:.0f}s")
    return out


if __name__ == "__main__":
    main()
