"""Generated modules, one per notebook: its ``#| export`` cells (scripts/export_notebooks.py, never
edited by hand). They import the library and the teaching floor only, not a per-notebook lesson."""
