"""`python -m eldr_services.decodeadapter`: run the decode adapter."""

import sys

from .service import main

sys.exit(main())
