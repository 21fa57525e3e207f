"""Thin integrations for the training frameworks people already use.

Each lives in its own module (``lightning``, ``hf``, ``accelerate``, ``torchtitan``, ``torchft``) and
imports its framework only when that module is imported
(``import trainstate.integrations.lightning``); importing ``trainstate``
never imports a framework. Install one with its extra, e.g.
``pip install "trainstate[lightning]"``.
"""
