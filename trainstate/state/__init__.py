"""What a generation holds: the restart state, and its capture and application.

- ``train_state``: :class:`TrainState`, the container a user registers components in.
- ``rng``: capture and restore of every random stream.
- ``contract``: the experiment contract (config, class order, architecture, ...) and its check.
- ``grads``: detection of gradients a backward pass left pending.
- ``snapshot``: turns a live state into a skeleton plus tensors, and a decoded payload back into live objects.
"""
