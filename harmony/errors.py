"""The one exception type users catch: every error harmony raises on bad input
says what was wrong and how to fix it."""


class HarmonyError(ValueError):
    """Bad input or an infeasible request, with a message meant for a person."""


class OutOfMemoryError(HarmonyError):
    """A plan or a step needs more device memory than the device has."""


class DeadlockError(HarmonyError):
    """A task graph whose tasks wait on each other forever."""


class NonFiniteError(HarmonyError):
    """A loss or gradient that is NaN or infinite, found before it was applied.
    ``what`` says which: ``"loss"`` or ``"gradient"``."""

    def __init__(self, message: str, what: str = "gradient"):
        super().__init__(message)
        self.what = what
