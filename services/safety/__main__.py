"""`python -m services.safety`: the safety service (see `services.safety.main`)."""

import sys

from services.safety.main import main

sys.exit(main())
