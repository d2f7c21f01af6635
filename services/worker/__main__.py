"""`python -m services.worker --role ...` (the same as `baton worker ...`)."""

import sys

from services.worker.main import main

sys.exit(main())
