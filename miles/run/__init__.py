"""A run: its phases, its checks before start, its directory (checkpoints, loggers, reports), replay."""
