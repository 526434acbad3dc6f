"""The lorad daemon."""
