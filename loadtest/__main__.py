"""`python -m loadtest ...`: the same as `baton bench ...`."""

import sys

from loadtest.cli import main

sys.exit(main())
