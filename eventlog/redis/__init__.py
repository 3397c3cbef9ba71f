"""The Redis backend of the coordinator port (``redis://`` and ``rediss://`` URLs)."""
