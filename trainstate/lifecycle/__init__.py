"""Policies over generations, and the I/O that applies them.

- ``retention``: what to keep (pure planning).
- ``generations``: pins, anchors, lineage and pruning on a store.
- ``candidates``: which generations a restore tries, in what order (the pointer, a roll-forward, timelines).
- ``cadence``: when to save (Young/Daly) and the measurements behind it.
- ``preemption``: signals turned into a save at the next boundary.
- ``rehearsal``: a restart into fresh objects, to prove a generation restores.
- ``keyless``: a signed run opened without its key (refused unless ``signing_key=False``).
- ``done``: the DONE record that says a run finished, and its verification.
- ``compute``: device kinds and wall time summed over a lineage's updates, recorded in each manifest.
- ``supervise`` / ``supervisor``: the bounded restart policy (pure) and the process loop applying it.
- ``sla``: per failure class, the interval, lost work and recovery a tiered run's measurements support (pure).
"""
