"""`stallfree worker`: one rank of a parallel engine started on another machine."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    # The rank's settings come from the environment (torchrun's names), not from flags.
    return subparsers.add_parser(
        "worker", help="one tensor/pipeline-parallel rank, for multi-machine runs "
                       "(reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)")


def run(args: argparse.Namespace) -> int:
    from ..distributed.worker import main as worker_main

    return worker_main()
