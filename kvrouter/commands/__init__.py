"""``kvrouter`` subcommands, one module each (``add_arguments``, ``run``)."""
