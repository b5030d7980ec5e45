"""The version of Miles (``miles.__version__``), importable without the package's public API."""

__version__ = "0.1.0"
