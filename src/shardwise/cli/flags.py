"""argparse types shared by the subcommands, so a bad flag stops with exit 2 before anything starts."""

from __future__ import annotations

import argparse
import math


def positive(kind: type):
    """A `kind` (int or float) above 0 and finite; argparse names the flag in its one-line error."""
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun} above 0; fix: pass {noun} above 0")
        return value
    return parse


def fraction(text: str) -> float:
    """A number in (0, 1]: a share of something, e.g. of a link's bandwidth."""
    value = positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is above 1; fix: pass a share in (0, 1], e.g. 0.8")
    return value
