"""`python -m eldr_services.simprefill`: same as `eldr serve simprefill`."""

from __future__ import annotations

import sys

from .service import main

if __name__ == "__main__":
    sys.exit(main())
