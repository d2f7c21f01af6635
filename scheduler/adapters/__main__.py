"""`python -m scheduler.adapters`: the scheduler service (same flags as `baton scheduler`)."""

import sys

from scheduler.adapters.main import main

if __name__ == "__main__":
    sys.exit(main())
