"""`python -m stallfree.bench serve|capacity|plot|convert ...`."""
import sys

from .cli import main

sys.exit(main())
