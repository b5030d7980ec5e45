"""A Miles reward plugin to copy."""
