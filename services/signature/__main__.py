"""`python -m eldr_services.signature`: the signature service (as `eldr serve signature`)."""

from __future__ import annotations

import sys

from .service import main

if __name__ == "__main__":
    sys.exit(main())
