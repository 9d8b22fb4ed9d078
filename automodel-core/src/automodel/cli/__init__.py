"""The ``automodel`` command line."""
