"""Worked solutions of the notebooks' exercises, one function per exercise.

Tested against the checkers in ``tests/test_exercises.py``; never imported by a notebook (each exercise
starts blank there). One block per notebook, in notebook order.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- 00 the passphrase experiment

# ----------------------------------------------------------------------------- 01 QKV and the KV cache

# ----------------------------------------------------------------------------- 02 manual prefix reuse

# ----------------------------------------------------------------------------- 03 position encoding

# ----------------------------------------------------------------------------- 04 the paged block manager

# ----------------------------------------------------------------------------- 05 shared vs isolated

# ----------------------------------------------------------------------------- 06 vLLM side by side

# ----------------------------------------------------------------------------- 07 isolation and security
