"""The data stream as restart state.

- ``loader``: :class:`ResumableLoader`, a DataLoader whose position is counted at consumption.
- ``continuation``: a saved position continued under another plan (world size, batch size), pure.
- ``order``: each epoch's order from ``(seed, epoch)``, independent of library versions, read per position.
- ``permute``: the ``feistel-v1`` keyed permutation: position to sample index, O(1), no array.
- ``mixture``: :class:`Mixture`, sources interleaved in set proportions, index-addressable.
- ``keys``: seeds derived from tuples of ints and labels.
- ``workers``: what the loader adds in DataLoader worker processes (exit with the parent, global-RNG watch).
- ``samplerng``: per-sample random generators addressed by ``(seed, epoch, index)``.
- ``files``: fingerprints of a dataset's files for the contract.
- ``evaluation``: evaluation that leaves no trace in the training state.
"""
