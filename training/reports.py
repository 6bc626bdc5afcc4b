"""What a run shows and leaves: the progress of an epoch, and metrics.json, metrics.csv and
training.png in the output folder."""
import csv
import io
import json
import math
import sys
import time

from tqdm import tqdm

from nn.serialization import atomic_write


class Progress:
    """An epoch's progress. On a terminal, tqdm's bar: images done, images/s, elapsed and remaining
    time, and the running loss (this rank's); elsewhere (a pipe, a log file) one line with the
    same figures when the epoch ends."""

    def __init__(self, images, label, stream=None):
        stream = sys.stderr if stream is None else stream   # as it is now (launch.forgiving_streams)
        self.images, self.label, self.stream = images, label, stream
        self.began, self.done, self.loss = time.perf_counter(), 0, None
        self.bar = tqdm(total=images, desc=label, unit="img", file=stream, leave=False, dynamic_ncols=True) \
            if stream.isatty() else None

    def update(self, done, loss):
        """``done`` images of the epoch trained so far (over all ranks); ``loss`` the running mean."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(done - self.done)
        self.done, self.loss = done, loss

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.done:
            seconds = time.perf_counter() - self.began
            self.stream.write(f"{self.label}: {self.done}/{self.images} images in {seconds:.1f} s, "
                              f"{self.done / seconds:.1f} images/s, loss {self.loss:.4f}\n")
            self.stream.flush()


def finite_or_none(entry):
    """A metrics entry with every non-finite number (a test loss that overflowed) as None, so
    that metrics.json and the checkpoint's record stay strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in entry.items()}


def write_reports(out, metrics):
    """metrics.json, metrics.csv and training.png, each replaced atomically."""
    with atomic_write(out / "metrics.json", "w") as f:
        json.dump(metrics, f, indent=1, allow_nan=False)
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
