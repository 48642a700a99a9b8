"""Every "is this node delegated, and why not" verdict: ``judge.judge`` runs the
named rules of one registry (``verdict.REGISTRY``): ``support`` (convolution_backward),
``max_pool`` (max_pool2d_with_indices_backward, and the forward max_pool2d_with_indices
whose indices go to the HTP), and ``judge``'s rules on every node."""

from .support import RULES, decide
from .target import Target
from .verdict import Decision, Rejection

__all__ = ["RULES", "Decision", "Rejection", "Target", "decide"]
