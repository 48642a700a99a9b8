"""QNN node visitors of qnn_convbwd."""
