"""The command line: one module per subcommand; each parses, calls the library, renders."""
