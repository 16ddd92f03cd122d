"""Lesson code: one module per notebook (its experiments, figures ``fig_*`` and exercise checkers).

``nb00_passphrase`` ... ``nb07_security`` belong to the notebooks of the same number; ``common`` holds
what several use; ``passphrase`` is the task of the bundled model; ``traces`` are token-id request traces
for the block manager and ``workloads`` the named experiments (seed groups, sys512). Lessons import the
engine and the cache; nothing under ``kvlab.cache`` or ``kvlab.engine`` imports a lesson.
"""
