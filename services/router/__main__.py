"""`python -m eldr_services.router`: run the routing service."""

import sys

from .service import main

sys.exit(main())
