"""What a run shows and leaves: the progress of an epoch, and metrics.json, metrics.csv and
training.png in the output folder."""
import csv
import io
import json
import sys

from nn.serialization import atomic_write


class Progress:
    """A one-line progress bar on a terminal; on a pipe, a line every tenth of the epoch."""

    def __init__(self, total, label, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.tty = stream.isatty()
        self.next_line = 0.1

    def update(self, done, loss):
        fraction = done / self.total
        if self.tty:
            bar = "#" * int(30 * fraction)
            self.stream.write(f"\r{self.label} [{bar:<30}] {done}/{self.total} loss {loss:.4f}")
        elif fraction >= self.next_line:
            self.stream.write(f"{self.label} {done}/{self.total} loss {loss:.4f}\n")
            self.next_line = (int(fraction * 10) + 1) / 10
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\r" + " " * (len(self.label) + 60) + "\r")
            self.stream.flush()


def write_reports(out, metrics):
    """metrics.json, metrics.csv and training.png, each replaced atomically."""
    with atomic_write(out / "metrics.json", "w") as f:
        json.dump(metrics, f, indent=1)
    with atomic_write(out / "metrics.csv", "w") as f:
        writer = csv.DictWriter(f, fieldnames=list(metrics[0]))
        writer.writeheader()
        writer.writerows(metrics)
    with atomic_write(out / "training.png") as f:
        f.write(plot(metrics))


def plot(metrics):
    """PNG bytes: train loss, train accuracy and test accuracy against epoch, as d2l draws them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [m["epoch"] for m in metrics]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(epochs, [m["train_loss"] for m in metrics], "o-", ms=3, label="train loss")
    ax.plot(epochs, [m["train_acc"] for m in metrics], "o--", ms=3, label="train acc")
    ax.plot(epochs, [m["test_acc"] for m in metrics], "o-.", ms=3, label="test acc")
    ax.set_xlabel("epoch")
    ax.set_xlim(1, max(epochs[-1], 2))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
