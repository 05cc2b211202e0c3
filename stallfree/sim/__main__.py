"""`python -m stallfree.sim {simulate,profile} ...`."""
import sys

from .cli import main

sys.exit(main())
