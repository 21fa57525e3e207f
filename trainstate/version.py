"""The library's version, in a module of its own so that any layer can record it without importing the face."""

__version__ = "0.1.0"
"""The installed trainstate version, recorded in every manifest (``versions.trainstate``)."""
