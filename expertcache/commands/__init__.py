"""Subcommands of the ``expertcache`` CLI, one module each (see `expertcache.cli`)."""
