"""Softmax cross-entropy, the mean over the batch of -log softmax(logits)[label].

The row maximum is subtracted before exponentiating so that exp cannot overflow; the
log-probability of the label is then shifted[label] - log(sum(exp(shifted))).
"""
import numpy as np


def softmax_cross_entropy_forward(logits, labels):
    _check(logits, labels)
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted)
    total = probs.sum(axis=1, keepdims=True)
    probs /= total
    rows = np.arange(len(labels))
    log_p = shifted[rows, labels] - np.log(total[:, 0])
    return np.asarray(-log_p.mean(), dtype=logits.dtype), probs


def softmax_cross_entropy_backward(dloss, probs, labels):
    _check(probs, labels)
    dlogits = probs.copy()
    dlogits[np.arange(len(labels)), labels] -= 1
    # A Python float keeps float32 logits in float32.
    dlogits *= float(dloss) / len(labels)
    return dlogits


def _check(logits, labels):
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"cross entropy expects logits (N, K) and labels (N,), "
                         f"got {logits.shape} and {labels.shape}")
    if 0 in logits.shape:
        raise ValueError(f"cross entropy needs at least one example and one class, got logits of shape {logits.shape}")
    # Negative labels would silently index from the end.
    if labels.size and (labels.min() < 0 or labels.max() >= logits.shape[1]):
        raise ValueError(f"labels must lie in [0, {logits.shape[1]}), "
                         f"got [{labels.min()}, {labels.max()}]")


def count_correct(logits, labels):
    """How many rows of ``logits`` have their largest value at the label: a 0-d int64
    array, left on the device so that training reads it only when it logs."""
    _check(logits, labels)
    return np.asarray(np.count_nonzero(logits.argmax(axis=1) == labels), dtype=np.int64)
