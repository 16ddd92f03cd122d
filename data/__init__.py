"""kvlab's shipped data: the bundled passphrase model, public model configs and the CJK font subset.

In the repository this folder is the top-level ``data/``; in the wheel it is ``kvlab/data`` (the
``package-dir`` mapping in ``pyproject.toml``). Code finds it with
``kvlab.engine.models.package_data``. This file only makes it a regular package for the wheel; it
holds no code.
"""
