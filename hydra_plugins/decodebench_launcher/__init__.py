"""Hydra plugin: decodebench's sweep launchers (see launcher.py), found by Hydra's plugin scan."""
