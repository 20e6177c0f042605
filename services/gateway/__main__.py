"""`python -m eldr_services.gateway`: run the gateway."""

import sys

from .service import main

sys.exit(main())
