"""Horizontal text bars: how full something is, drawn in characters."""

from __future__ import annotations

# A cell filled 0/8 .. 7/8 from the left (index 0 is never drawn).
EIGHTHS = " ▏▎▍▌▋▊▉"


def text_bar(
    fraction: float, width: int, *, fill: str = "█", empty: str = "", eighths: bool = False
) -> str:
    """A bar ``fraction`` of ``width`` cells long, then ``empty`` padding to ``width``.

    The length is rounded to the nearest whole cell, or with ``eighths`` to the
    nearest eighth of a cell, the last, partial cell drawn with one of
    :data:`EIGHTHS` (``fill`` should then be a full block). ``empty=""`` leaves the
    bar unpadded. Examples: ``text_bar(0.5, 10, fill="#", empty=".")`` is
    ``"#####....."``; ``text_bar(0.55, 2, eighths=True)`` is ``"█▏"``.

    ``fraction`` is not clamped, so each caller decides what out-of-range values
    show; one that may leave [0, 1] passes ``max(0.0, min(fraction, 1.0))``.
    Unclamped, a fraction above 1 draws more than ``width`` filled cells, and one
    below 0 none (in whole cells the padding then grows past ``width`` by as many
    cells as the rounded length is below 0). NaN raises ``ValueError``.
    """
    if not eighths:
        cells = round(fraction * width)
        return fill * cells + empty * (width - cells)
    units = max(0, round(fraction * width * 8))
    whole, part = divmod(units, 8)
    return fill * whole + (EIGHTHS[part] if part else "") + empty * (width - whole - bool(part))
