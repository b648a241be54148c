"""The ``kvguard`` command: one module per subcommand."""
