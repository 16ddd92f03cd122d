"""The build exercises' common step: carry on with the reader's piece when its check passed, else with kvlab's.

A build exercise (notebooks 01, 02, 04) has the reader write the piece the notebook is about; the cells after
it run with whatever ``use_reference`` returns, so the notebook runs either way (papermill runs leave the stub
blank and use kvlab's). Worked solutions: ``kvlab/lessons/solutions.py`` (functions named ``build_*``).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.lessons.common import Verdict


def use_reference(yours: Callable[..., Any] | None, check: Verdict, reference: Callable[..., Any],
                  solution: str = "") -> Callable[..., Any]:
    """``yours`` when ``check`` passed, else ``reference``; prints which one the following cells use."""
    if check:
        print(f"the cells below use YOUR {getattr(yours, '__name__', 'function')}")
        return yours
    where = f" (a worked solution: {solution} in kvlab/lessons/solutions.py)" if solution else ""
    print(f"the cells below use kvlab's {getattr(reference, '__name__', 'version')}: yours is not done yet{where}")
    return reference
