"""Where generations live.

- ``base``: the :class:`Store`/:class:`Staging` protocols every backend implements.
- ``local``: the local POSIX backend, the only code that calls fsync and rename.
- ``verify``: the trusted read path (pointer, manifest, files, digests) shared by every reader.
"""
