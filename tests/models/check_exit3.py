"""A hostile model file: ``sys.exit(3)`` at import, memplan's own "cannot measure" code."""

import sys

sys.exit(3)
