"""A hostile model file: it ends the process with ``os._exit(0)`` (no cleanup, no
exception anyone can catch) as it is imported."""

import os

os._exit(0)
