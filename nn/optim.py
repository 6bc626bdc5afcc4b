"""SGD on the flat parameter buffer, and learning-rate schedules."""
import math

from kernels import backend_of, get_array_module
from .modules import FlatParameters


class SGD:
    """PyTorch's SGD (dampening 0, no Nesterov), one kernel over all parameters."""

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0):
        if not lr > 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"momentum and weight decay must be >= 0, got {momentum}, {weight_decay}")
        self.flat = FlatParameters.of(params)
        self._lr_memory = None
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        xp = get_array_module(self.flat.data)
        self.velocity = xp.zeros_like(self.flat.data) if momentum else None

    @property
    def lr(self):
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = value
        if self._lr_memory is not None:
            self._lr_memory.fill(value)   # on the device, in stream order: a kernel, no wait

    def lr_on_device(self):
        """Keep the learning rate in device memory from now on, where the update reads it when it
        runs: what a CUDA graph of the step needs (setting ``lr`` then writes that memory)."""
        if self._lr_memory is None:
            self._lr_memory = get_array_module(self.flat.data).empty(1, self.flat.data.dtype)
            self.lr = self._lr

    def step(self):
        """One update of the float32 parameters, which also rounds them into the flat buffer's copy of the
        weights that the convolutions multiply, when there is one, in the same launch
        (FlatParameters.updating)."""
        lr = self.lr if self._lr_memory is None else self._lr_memory
        with self.flat.updating() as copy:
            backend_of(self.flat.data).sgd_update(self.flat.data, self.flat.grad, self.velocity,
                                                  lr, self.momentum, self.weight_decay, copy=copy)

    def zero_grad(self):
        self.flat.zero_grad()


class CosineAnnealingLR:
    """lr(t) = eta_min + (base - eta_min) (1 + cos(pi t / T_max)) / 2, stepped by the caller."""

    def __init__(self, optimizer, T_max, eta_min=0.0):
        if T_max < 1:
            raise ValueError(f"T_max must be >= 1, got {T_max}")
        self.optimizer, self.T_max, self.eta_min = optimizer, T_max, eta_min
        self.base_lr = optimizer.lr
        self.last_step = 0

    def lr_at(self, t):
        t = min(t, self.T_max)
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2

    def step(self):
        self.last_step += 1
        self.optimizer.lr = self.lr_at(self.last_step)
