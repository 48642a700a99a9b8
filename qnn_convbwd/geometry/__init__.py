"""Argument parsing and geometry of the ops the plugin lowers, shared by the
support rules (``partition/``), the passes and the builders (``builders/``)."""
