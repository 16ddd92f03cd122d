"""Generated modules: what each notebook writes in the open (its ``#| export`` cells), one module per notebook.

``kvlab.built.nb01`` is notebook 01's attention and FLOP count; ``nb03`` its RoPE; and so on.
Written by ``scripts/export_notebooks.py`` and checked against the notebooks in CI; never edited by hand.
Lessons, later notebooks and the tests import them; ``kvlab.cache`` and ``kvlab.engine`` never do, and they import
no per-notebook lesson module (only the teaching floor: ``passphrase``, ``traces``, ``workloads``, ``timing``, ``common``).
"""
