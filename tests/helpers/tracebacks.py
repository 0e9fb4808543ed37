"""Where an exception was raised: a structural check (which function refused an input) that replaces timing one."""

from __future__ import annotations


def raised_in(error: BaseException, function: str) -> bool:
    """Whether ``function`` (a code object's name) is on the traceback of ``error`` or of an error it chains."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name == function:
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False
