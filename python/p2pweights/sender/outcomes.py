"""What an update says became of the engines, and what sender 0's failed control step tells the others."""
from __future__ import annotations

from ..control import FailurePolicy
from ..errors import UpdateFailed

#: the failure policies an update offers (the engines serving partly written weights is not one of them)
ON_FAILURE = (FailurePolicy.RESUME_IF_UNWRITTEN, FailurePolicy.LEAVE_PAUSED)
UNTOUCHED = "nothing was written and the engines were not paused"
ROLLED_BACK = "nothing was written: the engines ended the session without a version bump and generate again"
LEFT_PAUSED = ("writes may have landed (or verify found weights that differ): the engines stay paused with their "
               "session open at their old version; the next complete update heals them")
KEPT_PAUSED = ("on_failure='leave_paused': the engines stay paused with their session open at their old version; "
               "the next complete update heals them")
NOT_CONTROLLED = "this update does not control the engines (control=False): their coordinator decides"


def control_failures(error: Exception | None) -> dict[str, str]:
    """What sender 0's failed control step tells the others: engine -> why."""
    if error is None:
        return {}
    if isinstance(error, UpdateFailed):
        return dict(error.failures)
    return {getattr(error, "engine", None) or "engines": f"{type(error).__name__}: {error}"}
