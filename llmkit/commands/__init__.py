"""One module per ``llmkit`` subcommand (see ``llmkit.cli``)."""
