"""Developer tools built on the public API: the CLI's subcommands (demo, train,
bench, fidelity, cost), reference models, weight-byte and device scripts.

The runtime (``import qnn_convbwd; qnn_convbwd.enable()``, ``lower``) never
imports this package (tests/test_structure.py).
"""
