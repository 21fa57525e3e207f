"""The data stream as restart state.

- ``loader``: :class:`ResumableLoader`, a DataLoader whose position is counted at consumption.
- ``order``: each epoch's order from ``(seed, epoch)``, independent of library versions.
- ``samplerng``: per-sample random generators addressed by ``(seed, epoch, index)``.
- ``files``: fingerprints of a dataset's files for the contract.
- ``evaluation``: evaluation that leaves no trace in the training state.
"""
