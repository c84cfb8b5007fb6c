"""memplan's version, in a module of its own: what a profile records (``memplan_version``)
and ``--version`` prints, importable without the package's lazy names."""

__version__ = "0.1.0"
