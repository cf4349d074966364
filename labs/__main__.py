"""`python -m labs`: see labs/cli.py (start, check, experiment, run, plant, starters)."""

import sys

from .cli import main

sys.exit(main())
