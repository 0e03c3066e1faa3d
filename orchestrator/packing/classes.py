"""MELL's size classes (Sec. VI-C): a session of S pages on bins of C pages is L, M, S, T or tiny.

    L: C/2 < S <= C    M: C/3 < S <= C/2    S: C/4 < S <= C/3    T: C/8 < S <= C/4    tiny: S <= C/8

Tiny sessions are grouped into multi-items of at most C/4 pages that count as T items. A multi-item of at most C/8
pages is "incomplete" (MELL wants them in (C/8, C/4]; one forming, or one whose members left, is smaller). All
comparisons are exact in integers.
"""

from __future__ import annotations

from enum import StrEnum


class SizeClass(StrEnum):
    L = "L"
    M = "M"
    S = "S"
    T = "T"
    TINY = "tiny"


_RANK = {SizeClass.TINY: 0, SizeClass.T: 1, SizeClass.S: 2, SizeClass.M: 3, SizeClass.L: 4}


def size_class(pages: int, capacity_pages: int) -> SizeClass:
    """Gives the class of a session of `pages` pages on bins of `capacity_pages` pages."""
    if pages < 0 or pages > capacity_pages:
        raise ValueError(f"a session of {pages} pages does not fit bins of {capacity_pages} pages")
    if 2 * pages > capacity_pages:
        return SizeClass.L
    if 3 * pages > capacity_pages:
        return SizeClass.M
    if 4 * pages > capacity_pages:
        return SizeClass.S
    if 8 * pages > capacity_pages:
        return SizeClass.T
    return SizeClass.TINY


def class_rank(size: SizeClass) -> int:
    """Gives the order of classes, tiny (0) < T < S < M < L (4): a bin's label is the class of highest rank on it."""
    return _RANK[size]


def fits_multi_item(pages: int, capacity_pages: int) -> bool:
    """Tells whether a multi-item of `pages` pages stays within C/4."""
    return 4 * pages <= capacity_pages


def is_incomplete_multi_item(pages: int, capacity_pages: int) -> bool:
    """Tells whether a multi-item of `pages` pages is at most C/8 (two of them always merge within C/4)."""
    return 8 * pages <= capacity_pages


def at_least_three_quarters(pages: int, capacity_pages: int) -> bool:
    """Tells whether a bin holding `pages` pages is at least 75% full (Theorem 1, properties 3 and 5)."""
    return 4 * pages >= 3 * capacity_pages
