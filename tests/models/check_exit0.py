"""A hostile model file: it ends the interpreter with ``sys.exit(0)`` as it is imported."""

import sys

sys.exit(0)
