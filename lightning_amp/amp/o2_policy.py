"""Deprecated path: see :data:`lightning_amp._moved.MOVED`."""
from lightning_amp._moved import alias

alias(__name__)
