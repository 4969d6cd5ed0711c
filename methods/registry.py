"""Imports every method module so that each registers itself by name."""

from . import ar, sps  # noqa: F401
