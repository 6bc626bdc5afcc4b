"""Weight initialisation from one seeded generator, drawn on the host.

Two schemes for layers with a fan-in (Conv2d, Linear): ``normal`` (weights ~
Normal(0, 0.01), zero biases, as in the text this project grew from) and
``pytorch`` (PyTorch's default: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))).
"""
import math

import numpy as np

from kernels import get_array_module

SCHEMES = ("normal", "pytorch")
_rng = np.random.default_rng(0)


def manual_seed(seed):
    global _rng
    _rng = np.random.default_rng(seed)


def get_rng_state():
    return _rng.bit_generator.state


def set_rng_state(state):
    _rng.bit_generator.state = state


def _assign(param, values):
    """param's data <- values (host), in place: a flat buffer's rounded copy is stale after it."""
    with param.writing():
        param.data[...] = get_array_module(param.data).asarray(values.astype(param.dtype))


def init_layer(weight, bias, scheme):
    """Initialise one layer's weight (out, fan_in...) and optional bias (Parameters) in place."""
    if scheme == "normal":
        _assign(weight, _rng.normal(0.0, 0.01, weight.shape))
        if bias is not None:
            _assign(bias, np.zeros(bias.shape))
    elif scheme == "pytorch":
        bound = 1.0 / math.sqrt(int(np.prod(weight.shape[1:])))
        _assign(weight, _rng.uniform(-bound, bound, weight.shape))
        if bias is not None:
            _assign(bias, _rng.uniform(-bound, bound, bias.shape))
    else:
        raise ValueError(f"unknown init scheme {scheme!r}: choose one of {SCHEMES}")


def init_model(model, scheme="normal"):
    """Re-initialise every layer of ``model`` that has a fan-in with ``scheme``."""
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters(scheme)
    return model
