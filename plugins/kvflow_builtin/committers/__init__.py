"""Built-in committers."""
