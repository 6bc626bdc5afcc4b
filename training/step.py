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
    """train_step as a CUDA graph for global batches of ``size`` images (kernels' ``Backend.capture``).

    The first such batch runs eagerly (the warm-up: every kernel compiled, every counter made);
    the second is captured, and every one from then on replays the graph after refilling its
    static inputs in place: the batch's indices, and the learning rate, which the optimizer keeps
    in device memory (SGD.lr_on_device). The loss and the correct count that a replay writes are
    copied out before the next replay overwrites them, and the batch-norm step counters (host
    numbers the forward increments) move once per replay. The replayed convolutions read the flat
    buffer's copy of the weights rounded to the precision (bfloat16, TF32), which the replayed update
    keeps current; should anything else have written the weights since, it is refreshed first, outside
    the graph.

    Whether a step replays is the same on every rank of ``ddp``, as NCCL requires of collectives
    in graphs: a global batch of another size (an epoch's last, shorter one) runs eagerly, even on
    a rank whose shard has the usual size (the capture baked in the loss share and sync batch norm's
    count of the whole batch); and the ranks agree on the outcome of the capture (one small
    collective): if it fails on any rank, ``warn`` gets one line and every rank runs the step
    eagerly from then on."""

    def __init__(self, model, opt, ddp, images, labels, size, warn):
        self.model, self.opt, self.ddp, self.images, self.labels = model, opt, ddp, images, labels
        self.size, self.warn = size, warn
        self.batch_norms = [m for m in model.modules() if isinstance(m, BatchNorm2d)]
        self.warmed_up, self.eager_only = False, False
        self.graph = self.idx = self.outputs = None
        opt.lr_on_device()

    def __call__(self, idx):
        """The step on this rank's shard ``idx`` of the global batch that ``ddp.scatter`` gave it."""
        whole = self.ddp.batch_size == self.size
        if not whole or self.eager_only or not self.warmed_up:
            self.warmed_up = self.warmed_up or whole
            return train_step(self.model, self.opt, self.ddp, self.images, self.labels, idx)
        # the replayed convolutions read the rounded copy without asking for it (nor is its refresh captured)
        self.opt.flat.refresh_multiplied()
        if self.graph is None and not self._capture(idx):
            return train_step(self.model, self.opt, self.ddp, self.images, self.labels, idx)
        self.idx[...] = idx
        self.graph.launch()
        for m in self.batch_norms:
            m.num_batches_tracked += 1
        return tuple(a.copy() for a in self.outputs)

    def _capture(self, idx):
        """Capture the step on the static index buffer; False (after the warning) if that failed on
        any rank."""
        counters = [m.num_batches_tracked.copy() for m in self.batch_norms]
        self.idx, error = idx.copy(), None
        try:
            self.graph, self.outputs = backend_of(self.images).capture(
                lambda: train_step(self.model, self.opt, self.ddp, self.images, self.labels, self.idx))
        except Exception as e:   # whatever the capture met, training goes on without it
            error = e
        finally:   # the capture ran the forward's host code once, and no step
            for m, count in zip(self.batch_norms, counters):
                m.num_batches_tracked[...] = count
        comm = self.ddp.comm
        failed = [rank for rank, f in enumerate(comm.all_gather_scalar(float(error is not None))) if f]
        if not failed:
            return True
        self.eager_only, self.graph = True, None
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        self.warn(f"--graph: capturing the training step failed{cause}; it runs eagerly" if comm.world_size == 1 else
                  f"--graph: capturing the training step failed on rank(s) {failed}{cause}; every rank runs it "
                  f"eagerly")
        return False
