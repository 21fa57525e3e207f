"""The ``trainstate`` command line and its demo."""

from .main import main

__all__ = ["main"]
