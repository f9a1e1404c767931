"""`python -m hf_paged serve MODEL ...` (the same as the `hf-paged` command)."""

from __future__ import annotations

import os
import sys

from .errors import ServeUnavailable
from .serve.cli import main as cli_main


def refuse_distributed_launch(environ=os.environ) -> None:
    """Raise `ServeUnavailable` inside a multi-process launch (`torchrun --nproc-per-node N`, N > 1).

    NOTE: the server is one process: one HTTP listener, one Engine on one model. Under torchrun every rank would load
    the whole model and bind the same port; serving a tensor-parallel model needs rank 0 to answer HTTP and the other
    ranks to follow its engine calls, which the server does not do. The Engine itself runs under torchrun (one per
    rank, in lockstep: docs/parallel.md)."""
    world_size = environ.get("WORLD_SIZE", "1")
    if world_size.isdigit() and int(world_size) > 1:
        raise ServeUnavailable(
            f"hf-paged serve runs in one process, got WORLD_SIZE={world_size} (a torchrun launch of "
            f"{world_size} ranks); start it without torchrun on one device (--device cuda:0). The Engine runs under "
            "torchrun with a tensor-parallel model (see docs/parallel.md)"
        )


def main(argv: list[str] | None = None) -> None:
    try:
        refuse_distributed_launch()
    except ServeUnavailable as error:
        sys.exit(f"hf-paged: {error}")
    cli_main(argv)


if __name__ == "__main__":
    main()
