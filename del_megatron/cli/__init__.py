"""Command-line entry points: parse, validate, call the library, map errors to one line."""
