"""`python -m ladder ...`: the `ladder` command (main.py), for a checkout without the install's PATH entry."""

import sys

from .main import main

sys.exit(main())
