"""The trainer's training step, run eagerly or replayed as a CUDA graph (``--graph``)."""
from kernels import backend_of
from nn.functional import cross_entropy
from nn.modules import BatchNorm2d
from nn.tensor import Tensor


def train_step(model, opt, ddp, images, labels, idx):
    """One step on the images and labels at idx (this rank's shard of the batch, a device array
    of indices): gather and convert them, forward, loss, backward with the gradients summed over
    the ranks of ``ddp``, SGD. Returns the loss and the number of correct predictions, arrays on
    the device, unread."""
    K = backend_of(images)
    x, y = Tensor(K.images_to_float(images, idx)), K.take(labels, idx)
    opt.zero_grad()
    logits = model(x)
    loss = cross_entropy(logits, y)
    ddp.backward(loss)
    opt.step()
    return loss.data, K.count_correct(logits.data, y)


class GraphedStep:
    """train_step as a CUDA graph for batches of ``size`` images (kernels' ``Backend.capture``).

    The first such batch runs eagerly (the warm-up: every kernel compiled, every counter made);
    the second is captured, and every one from then on replays the graph after refilling its
    static inputs in place: the batch's indices, and the learning rate, which the optimizer keeps
    in device memory (SGD.lr_on_device). The loss and the correct count that a replay writes are
    copied out before the next replay overwrites them, and the batch-norm step counters (host
    numbers the forward increments) move once per replay. A batch of another size (an epoch's
    last, shorter one) runs eagerly. If the capture fails, ``warn`` gets one line and the step
    runs eagerly from then on."""

    def __init__(self, model, opt, ddp, images, labels, size, warn):
        self.model, self.opt, self.ddp, self.images, self.labels = model, opt, ddp, images, labels
        self.size, self.warn = size, warn
        self.batch_norms = [m for m in model.modules() if isinstance(m, BatchNorm2d)]
        self.warmed_up, self.eager_only = False, False
        self.graph = self.idx = self.outputs = None
        opt.lr_on_device()

    def __call__(self, idx):
        if len(idx) != self.size or self.eager_only or not self.warmed_up:
            self.warmed_up = self.warmed_up or len(idx) == self.size
            return train_step(self.model, self.opt, self.ddp, self.images, self.labels, idx)
        if self.graph is None and not self._capture(idx):
            return train_step(self.model, self.opt, self.ddp, self.images, self.labels, idx)
        self.idx[...] = idx
        self.graph.launch()
        for m in self.batch_norms:
            m.num_batches_tracked += 1
        return tuple(a.copy() for a in self.outputs)

    def _capture(self, idx):
        """Capture the step on the static index buffer; False (after the warning) if that fails."""
        counters = [m.num_batches_tracked.copy() for m in self.batch_norms]
        self.idx = idx.copy()
        try:
            self.graph, self.outputs = backend_of(self.images).capture(
                lambda: train_step(self.model, self.opt, self.ddp, self.images, self.labels, self.idx))
        except Exception as e:   # whatever the capture met, training goes on without it
            self.eager_only, self.graph = True, None
            self.warn(f"--graph: capturing the training step failed ({type(e).__name__}: {e}); it runs eagerly")
        finally:   # the capture ran the forward's host code once, and no step
            for m, count in zip(self.batch_norms, counters):
                m.num_batches_tracked[...] = count
        return self.graph is not None
