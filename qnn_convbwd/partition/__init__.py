"""Support decisions for convolution_backward (see support.py)."""

from .support import RULES, Decision, Rejection, decide
from .target import Target

__all__ = ["RULES", "Decision", "Rejection", "Target", "decide"]
