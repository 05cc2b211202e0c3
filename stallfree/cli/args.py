"""Shared pieces of the command line: flags made from config fields, and flag types.

A config field made with `stallfree.config.option` carries its default, help,
flags, choices and parser; `add_setting_args` turns each into one flag, and
`settings_from_args` reads the parsed values back by field name, so a default
is written once, on the field.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ..bench.capacity import parse_budget
from ..bench.workload import WorkloadConfig
from ..config import EngineConfig, engine_setting_fields, parse_size, setting_fields
from ..scheduler.cost_fit import OnlineCost

_BUILTINS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type: its ValueError becomes a usage error naming the flag."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = parse.__name__
    return convert


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _comma_list(name: str, kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in _split(text)]
        except ValueError:
            raise ValueError(f"expected comma-separated {what}: {text!r}") from None
    parse.__name__ = name  # argparse names the type in its errors
    return flag_type(parse)


# Flag types of the commands: comma lists ("0.1,0.5", "sarathi,vllm") and sizes ("1GiB").
floats = _comma_list("floats", float, "numbers")
ints = _comma_list("ints", int, "integers")
budgets = _comma_list("budgets", parse_budget, "integers (token budgets) or slo")
words = _comma_list("words", str, "words")
size = flag_type(parse_size)


def _value_type(f: dataclasses.Field, default: Any) -> Callable[[str], Any]:
    """The field's parser, else the type its annotation names (`int | None` -> int)."""
    if f.metadata["parse"] is not None:
        return f.metadata["parse"]
    names = [part.strip() for part in str(f.type).split("|")]
    names = [name for name in names if name != "None"]
    if len(names) == 1 and names[0] in _BUILTINS:
        return _BUILTINS[names[0]]
    return type(default) if default is not None else str


def add_setting_args(parser: Any, fields: list[dataclasses.Field]) -> None:
    """One flag per config field, with the field's default, help, choices and parser.

    A bool field is a switch that flips its default (`--roofline`, `--no-detail`), or,
    when it defaults to True under a positive name, a pair (`--enable-prefix-caching` /
    `--no-enable-prefix-caching`); `nargs` and `metavar` in a field's metadata are passed
    on to argparse.
    """
    for f in fields:
        meta = f.metadata
        flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        help_text = meta["help"].replace("%", "%%")
        if str(f.type) == "bool":
            if default and not flags[0].startswith("--no-"):
                action: Any = argparse.BooleanOptionalAction
            else:
                action = "store_false" if default else "store_true"
            parser.add_argument(*flags, dest=f.name, default=default, help=help_text,
                                action=action)
            continue
        parser.add_argument(*flags, dest=f.name, default=default,
                            type=flag_type(_value_type(f, default)), choices=meta["choices"],
                            help=help_text, nargs=meta["nargs"], metavar=meta["metavar"])


def pick(cls: type, *names: str) -> list[dataclasses.Field]:
    """Some setting fields of `cls`, in the order named."""
    by_name = {f.name: f for f in setting_fields(cls)}
    return [by_name[name] for name in names]


def settings_except(cls: type, *names: str) -> list[dataclasses.Field]:
    """The setting fields of `cls` but those named."""
    return [f for f in setting_fields(cls) if f.name not in names]


def settings_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed value of each setting field of `cls` that has a flag in `args`."""
    return {f.name: getattr(args, f.name) for f in setting_fields(cls) if hasattr(args, f.name)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (names follow vLLM's)."""
    add_setting_args(parser, engine_setting_fields())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings of parsed `add_engine_args` flags, by field name."""
    return {f.name: getattr(args, f.name) for f in engine_setting_fields()}


def engine_config_from_args(args: argparse.Namespace, **changes: Any) -> EngineConfig:
    """The EngineConfig of parsed `add_engine_args` flags (with some settings changed)."""
    return EngineConfig.from_kwargs(**(engine_kwargs(args) | changes))


def add_profile_arg(parser: argparse.ArgumentParser) -> None:
    """`--profile DIR`: the TBT SLO's cost model starts from a `stallfree profile` result."""
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="with --tbt-slo: start the iteration cost model from this "
                             "`stallfree profile` folder (device cpu) instead of a short "
                             "calibration at start-up")


def slo_cost_seed(args: argparse.Namespace, config: EngineConfig) -> OnlineCost | None:
    """The `OnlineCost` fitted to the `--profile` folder's cost model, or None without one."""
    if args.profile is None:
        return None
    sched = config.scheduler
    if sched.tbt_slo is None:
        raise ValueError("--profile seeds the cost model of --tbt-slo: give --tbt-slo too")
    from ..sim.run import Deployment  # the simulator's cost model, without torch
    from ..sim.slo_fit import fit_cost_model

    deployment = Deployment(model=config.model or "smollm2-135m", gpu="cpu",
                            profile_dir=args.profile)
    return fit_cost_model(deployment.cost_model(), sched.token_budget,
                          sched.max_model_len or sched.token_budget)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags of `bench` and `simulate` (the request rate is each command's)."""
    add_setting_args(parser.add_argument_group("workload"),
                     settings_except(WorkloadConfig, "request_rate"))


def workload_config_from_args(args: argparse.Namespace, rate: float = math.inf
                              ) -> WorkloadConfig:
    return WorkloadConfig(**settings_from_args(WorkloadConfig, args) | {"request_rate": rate})
