"""`stallfree convert --to-hf DIR`: a model as a Hugging Face folder (`bench/convert.py`)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import DTYPES


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="write a model as a Hugging Face directory")
    p.add_argument("--to-hf", required=True, metavar="DIR", help="output directory")
    p.add_argument("--model", default=None,
                   help="GGUF file or HF directory (default: SmolLM2-135M-Instruct GGUF)")
    # float32 by default, not the engine's dtype: the file keeps the dequantised values.
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="stored dtype (float32 keeps the dequantised values exactly)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    return p


def run(args: argparse.Namespace) -> int:
    from ..bench.convert import convert_to_hf  # torch and the model load only here

    try:
        path = convert_to_hf(args.to_hf, args.model, args.dtype, args.force)
    except (ValueError, FileNotFoundError) as err:
        print(f"stallfree convert: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
