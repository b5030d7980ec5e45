"""Builtin plugins. Each module is a plugin registered through the same path as entry points."""
