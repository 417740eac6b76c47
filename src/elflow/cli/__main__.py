"""`python -m elflow.cli`: the command line (what torchrun starts on every rank)."""

import sys

from elflow.cli import main

sys.exit(main())
