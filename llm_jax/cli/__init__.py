"""Command-line programs; ``scripts/*.py`` are thin wrappers around the ``main`` functions here."""
