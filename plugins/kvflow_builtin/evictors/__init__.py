"""Built-in evictors."""
