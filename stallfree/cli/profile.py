"""`stallfree profile`: measure this machine's costs for the simulator (`stallfree.profiler`)."""
from __future__ import annotations

import argparse
from typing import Any

from ..config import setting_fields
from ..profiler import ProfileConfig
from .args import add_setting_args, settings_from_args


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure this machine's costs for the simulator")
    add_setting_args(p, setting_fields(ProfileConfig))
    return p


def run(args: argparse.Namespace) -> int:
    from ..profiler import run_profile

    run_profile(ProfileConfig(**settings_from_args(ProfileConfig, args)))
    return 0
