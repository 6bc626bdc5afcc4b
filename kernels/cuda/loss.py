"""Launchers of loss.cu: softmax cross-entropy forward (probabilities and the 0-d mean loss)
and backward, and the count of correct predictions, all without a host synchronisation."""
import numpy as np

from .launch import C_TYPES, blocks, cdiv, float32, integers, launch, sum_partials

OPS = ("softmax_cross_entropy_forward", "softmax_cross_entropy_backward", "count_correct")
ROWS_PER_BLOCK = 8
KERNELS = tuple(f"{kernel}<{t}>" for kernel in ("softmax_xent_forward", "softmax_xent_backward", "count_correct")
                for t in C_TYPES.values()) + ("sum_partials",)


def softmax_cross_entropy_forward(be, logits, labels):
    (logits,) = float32(be, "softmax_cross_entropy_forward", logits)
    labels = integers(be, "softmax_cross_entropy_forward", labels)
    n, k = _sizes(logits, labels)
    probs = be.xp.empty_like(logits)
    partial = be.xp.empty((cdiv(n, ROWS_PER_BLOCK),), np.float32)
    launch(be, "loss", f"softmax_xent_forward<{C_TYPES[labels.dtype]}>", partial.shape,
           (logits, labels, n, k, probs, partial))
    loss = be.xp.empty((), np.float32)
    sum_partials(be, "loss", partial, partial.size, loss, scale=1 / n)
    return loss, probs


def softmax_cross_entropy_backward(be, dloss, probs, labels):
    (probs,) = float32(be, "softmax_cross_entropy_backward", probs)
    labels = integers(be, "softmax_cross_entropy_backward", labels)
    n, k = _sizes(probs, labels)
    if not isinstance(dloss, be.xp.ndarray):
        # a host number (1.0 to start a backward pass): one small copy, no synchronisation
        dloss = be.xp.asarray(np.float32(dloss))
    (dloss,) = float32(be, "softmax_cross_entropy_backward", dloss)
    if dloss.size != 1:
        raise ValueError(f"cross entropy dloss must hold one value, got shape {dloss.shape}")
    dlogits = be.xp.empty_like(probs)
    launch(be, "loss", f"softmax_xent_backward<{C_TYPES[labels.dtype]}>", blocks(probs.size),
           (dloss, probs, labels, n, k, dlogits))
    return dlogits


def count_correct(be, logits, labels):
    (logits,) = float32(be, "count_correct", logits)
    labels = integers(be, "count_correct", labels)
    n, k = _sizes(logits, labels)
    count = be.xp.empty((), np.int64)
    launch(be, "loss", f"count_correct<{C_TYPES[labels.dtype]}>", (1,), (logits, labels, n, k, count))
    return count


def _sizes(logits, labels):
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"cross entropy expects logits (N, K) and labels (N,), got {logits.shape} and {labels.shape}")
    if 0 in logits.shape:
        raise ValueError(f"cross entropy needs at least one example and one class, got logits of shape {logits.shape}")
    return logits.shape
