"""Draw a ``finetune.FitResult`` (JSON on stdin) as a PNG: both loss curves, both accuracy
curves.

Run as a script in a child process by ``FitResult.plot`` (matplotlib is not imported
where executorch's runtime has loaded the QNN libraries); imports only matplotlib.
"""

from __future__ import annotations

import json
import sys


def draw(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, accuracies) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = range(1, len(data["program_loss"]) + 1)
    torch = data.get("torch", True)  # False: the program trained alone
    if torch:
        losses.plot(steps, data["torch_loss"], "-", lw=1, label="torch eager fp32 + SGD")
    losses.plot(steps, data["program_loss"], "--", lw=1, label=data["program"])
    losses.set_xlabel("step")
    losses.set_ylabel("training loss (batch)")
    losses.legend()
    percent = [[100 * a for a in data[k]] for k in ("torch_accuracy", "program_accuracy")]
    if torch:
        accuracies.plot(data["eval_steps"], percent[0], "o-", label="torch eager fp32 + SGD")
    accuracies.plot(data["eval_steps"], percent[1], "x--", label=data["program"])
    accuracies.set_xlabel("step")
    accuracies.set_ylabel("held-out accuracy (%)")
    accuracies.set_ylim(0, 100)
    accuracies.legend()
    figure.suptitle(data["title"], fontsize=10)
    figure.tight_layout()
    figure.savefig(data["path"], dpi=100)


if __name__ == "__main__":
    draw(json.load(sys.stdin))
