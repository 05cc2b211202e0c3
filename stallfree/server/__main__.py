"""`python -m stallfree.server [MODEL] [flags]`: the same as `stallfree serve`."""
import argparse
import sys

from ..cli import add_engine_args
from .serve import add_serve_args, run_server

parser = argparse.ArgumentParser(prog="python -m stallfree.server",
                                 description="OpenAI-compatible stallfree server")
add_engine_args(parser)
add_serve_args(parser)
sys.exit(run_server(parser.parse_args()))
