"""The EAGLE family: `eagle` (EAGLE-1's static tree), `eagle2` (EAGLE-2's dynamic tree) and `eagle3`
(the EAGLE-3 head drafting EAGLE-2's tree). Importing the package registers the three
(`base.available_methods` imports every module and package beside `base.py`)."""

from . import dynamic, eagle3  # noqa: F401  (they register the methods)
