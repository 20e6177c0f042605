"""`python -m eldr_services.trainer`: run the trainer service."""

import sys

from .service import main

sys.exit(main())
