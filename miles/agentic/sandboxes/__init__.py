"""Sandboxes: the builtin local one (bubblewrap or rlimits) and the base of the hosted ones."""
