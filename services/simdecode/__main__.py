"""`python -m eldr_services.simdecode`: same as `eldr serve simdecode`."""

from __future__ import annotations

import sys

from .service import main

if __name__ == "__main__":
    sys.exit(main())
