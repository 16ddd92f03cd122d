"""The build exercises' common step: carry on with the reader's piece when its check passed, else
with kvlab's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.lessons.common import Verdict


def use_reference(yours: Callable[..., Any] | None, check: Verdict, reference: Callable[..., Any],
                  solution: str = "") -> Callable[..., Any]:
    """``yours`` when ``check`` passed, else ``reference``; prints which one the following cells
    use."""
    if check:
        print(f"the cells below use YOUR {getattr(yours, '__name__', 'function')}")
        return yours
    where = f" (a worked solution: {solution} in kvlab/lessons/solutions.py)" if solution else ""
    print(f"the cells below use kvlab's {getattr(reference, '__name__', 'version')}: yours is not "
          f"done yet{where}")
    return reference
