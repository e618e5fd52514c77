"""The ``llmctl`` command line: one module per subcommand, registered in ``app``."""
