"""The module hook: a callback around every module's forward and backward.

``register_module_hook(fn)`` installs ``fn(module, event)`` with event one of
``forward_begin``, ``forward_end``, ``backward_begin``, ``backward_end``.

Forward events come from ``Module.__call__``. Backward events are derived from the
tape: every node records the path of modules (outermost first) that were running
when it was created, and as the backward pass walks the nodes it leaves and
enters modules wherever two consecutive nodes' paths differ.
"""
import contextlib

_hooks = []
_path = ()  # modules whose forward is running now, outermost first


class HookHandle:
    """What a hook's registration returns: ``remove()`` takes ``fn`` out of ``registry`` again."""

    def __init__(self, registry, fn):
        self.registry, self.fn = registry, fn
        registry.append(fn)

    def remove(self):
        if self.fn in self.registry:
            self.registry.remove(self.fn)


def register_module_hook(fn):
    """Call ``fn(module, event)`` around every module's forward and backward."""
    return HookHandle(_hooks, fn)


def current_path():
    return _path


def _fire(module, event):
    for fn in list(_hooks):
        fn(module, event)


@contextlib.contextmanager
def module_scope(module):
    """Run a module's forward: inside it, new tape nodes belong to ``module``."""
    global _path
    outer = _path
    _path = outer + (module,)
    _fire(module, "forward_begin")
    try:
        yield
    finally:
        _path = outer
    _fire(module, "forward_end")


def move_backward(old, new):
    """Backward moves from a node of path ``old`` to one of path ``new``:
    end the modules it leaves (innermost first), begin the ones it enters."""
    common = 0
    for a, b in zip(old, new):
        if a is not b:
            break
        common += 1
    for module in reversed(old[common:]):
        _fire(module, "backward_end")
    for module in new[common:]:
        _fire(module, "backward_begin")
    return new
