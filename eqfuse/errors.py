"""The errors eqfuse raises: each names the problem in one line."""


def one_line(e: BaseException) -> str:
    """``e`` as its type and the first line of its message: how a report or a warning
    names an exception that eqfuse caught and worked around."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class EqfuseError(Exception):
    """Base class of every error eqfuse raises on purpose."""


class CaptureError(EqfuseError):
    """The function could not be traced to an FX graph (bad input, shapes that do not broadcast)."""


class Unsupported(EqfuseError):
    """An op, dtype or form the kernels do not cover; the node runs in eager instead."""


class Unschedulable(EqfuseError):
    """A fused kernel body that the code generator cannot schedule (extraction avoids these).
    ``store``: the e-classes of the values whose storing by a kernel of their own would
    make the body schedulable, where the code generator knows them; extraction's repair
    tries those first."""

    def __init__(self, message: str, store: tuple = ()):
        super().__init__(message)
        self.store = tuple(c for c in store if c)


class ExtractionError(EqfuseError):
    """No legal plan could be extracted from the e-graph."""

    def __init__(self, message: str, retry: bool = False):
        super().__init__(message)
        self.retry = retry  # the e-graph itself looked inconsistent: building again may help


def kind_of(x) -> str:
    """``x``'s type with its article, for a message: "a float", "an int", "a NoneType"."""
    name = type(x).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
