"""Progress bars: live in a terminal or a notebook, absent from logs (a bar redrawn into a file is noise)."""

from __future__ import annotations

import sys
from typing import Any


def live_display() -> bool:
    """Whether a progress display can redraw in place: stderr is a terminal, or this runs in a Jupyter kernel."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) or "ipykernel" in sys.modules


def progress_bar(total: int, desc: str, unit: str, initial: int = 0) -> Any:
    """A tqdm bar (notebook widget in Jupyter) where it can be live; a disabled one (no output) elsewhere."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, disable=not live_display()
    )
