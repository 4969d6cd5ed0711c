"""Imports every method module so that each registers itself by name."""

from . import ar, eagle, jacobi, lazyllm, mcsd, medusa, sps  # noqa: F401
