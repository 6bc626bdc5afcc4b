"""Batches of a dataset, as torch.utils.data samples them: one seeded order per epoch (a NumPy
array of indices, which the caller moves to the dataset's device), cut into consecutive batches."""
import numpy as np


def epoch_order(n, seed, epoch):
    """The shuffled order of ``n`` examples in ``epoch``: a function of (seed, epoch)
    only, so a resumed run sees exactly the batches an uninterrupted one would."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(order, batch_size):
    """Consecutive batches of ``order``; the last one is short when ``batch_size``
    does not divide the number of examples."""
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
