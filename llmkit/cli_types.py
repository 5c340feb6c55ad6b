"""argparse value types that reject bad values with a message naming the value."""

from __future__ import annotations

import argparse


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


def nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def unit_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not a number") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in (0, 1]")
    return v


def open_unit_float(s: str) -> float:
    """A number strictly between 0 and 1 (an error probability, a fraction that must leave room on both sides)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not a number") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in (0, 1), both ends excluded")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not a number") from None
    if not v > 0.0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{v} must be a finite number > 0")
    return v
