"""Built-in pruners."""
