"""Imports every method module so that each registers itself by name."""

from . import ar, eagle, medusa, sps  # noqa: F401
