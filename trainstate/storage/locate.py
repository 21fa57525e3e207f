"""A run's location to its store: a local directory, or an object-store URL (``s3://``, ``gs://``, ``az://``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from .base import Store
from ..format.digest import FAST_CHUNKED
from .local import LocalStore
from .objectclient import is_url


def open_store(location: str | Path, digest: str = FAST_CHUNKED, *, storage_options: dict[str, Any] | None = None,
               create: bool = True) -> Store:
    """The store for ``location``; ``storage_options`` (endpoint, region, keys, ...) apply to URLs only."""
    if is_url(str(location)):
        from .objects import ObjectStore

        return ObjectStore(str(location), digest, storage_options=storage_options)
    if storage_options:
        raise InvalidArgument(f"storage_options apply to object-store URLs (s3://, gs://, az://); {location} is a "
                              "local directory")
    return LocalStore(location, digest, create=create)


def open_existing(location: str) -> Store:
    """A run for the command line to read: a local directory that must exist, or a URL (its credentials and
    endpoint from the environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_ALLOW_HTTP``, ...)."""
    if is_url(location):
        return open_store(location)
    if not Path(location).is_dir():
        raise FileNotFoundError(f"{location} is not a directory")
    return LocalStore(location, create=False)


def split_generation(target: str) -> tuple[str, str | None]:
    """``run/gen-000000000004`` (a path or URL) to its run and the generation it names; else ``(target, None)``."""
    from ..format.manifest import parse_generation_name

    head, _, tail = target.rstrip("/").rpartition("/")
    if head and parse_generation_name(tail) is not None:
        return head, tail
    return target, None
