"""``python -m memplan.cli``: the same as the ``memplan`` console script."""

from memplan.cli import main

main()
