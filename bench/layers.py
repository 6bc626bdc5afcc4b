"""ResNet-18's layers as the ops a training step runs on them, with their exact shapes.

``resnet18_layers(batch)`` walks the model of DESIGN.md (nn/resnet.py) and lists one ``Layer``
per op call of the forward pass, in order, named by module path; then the SGD update of all
parameters. ``distinct(layers)`` keeps each shape once, with how often it occurs per step, which
is what the GPU tests check and the benchmarks time. tests/test_gpu_check.py holds this list
against the ops the real model calls.
"""
import dataclasses
import math
from collections import Counter

from kernels.cpu._util import output_size

BATCH = 256       # the batch of the training command and of every full-shape check
IMAGE = 28        # Fashion-MNIST's images: 1 x 28 x 28
CLASSES = 10
EPOCH_IMAGES = 60000


@dataclasses.dataclass(frozen=True)
class Layer:
    """One op call: ``op`` is the kernel family's name in the contract (kernels/cpu/__init__.py), or
    batch_norm_relu and batch_norm_add_relu for batch norm with its relu join fused in;
    ``x`` the shape of its input (for sgd_update, of the flat parameter buffer); ``w`` the
    weight's shape for conv2d and linear."""
    op: str
    name: str
    x: tuple
    w: tuple = None
    stride: int = 1
    padding: int = 0

    @property
    def key(self):
        """What decides the work: everything but the name."""
        return self.op, self.x, self.w, self.stride, self.padding

    @property
    def y(self):
        """The output's shape."""
        if self.op == "conv2d":
            n, _, h, w = self.x
            o, _, kh, kw = self.w
            return n, o, output_size(h, kh, self.stride, self.padding), output_size(w, kw, self.stride, self.padding)
        if self.op == "linear":
            return self.x[0], self.w[0]
        if self.op == "global_avg_pool":
            return self.x[:2]
        if self.op == "images_to_float":
            return (self.x[0], 1) + self.x[1:]
        return self.x

    @property
    def label(self):
        """A short description, e.g. 'conv 3x3/2 64->128 28->14'."""
        if self.op == "conv2d":
            o, c, kh, kw = self.w
            return f"conv {kh}x{kw}/{self.stride} {c}->{o} {_size(self.x)}->{_size(self.y)}"
        if self.op == "linear":
            return f"linear {self.w[1]}->{self.w[0]}"
        if self.op == "sgd_update":
            return f"sgd {self.x[0]:,}"
        if self.op == "softmax_cross_entropy":
            return f"softmax xent {self.x[1]}"
        return f"{self.op.replace('_', ' ')} {'x'.join(map(str, self.x[1:]))}"


def _size(shape):
    h, w = shape[2:]
    return str(h) if h == w else f"{h}x{w}"


def parameter_shapes(layers):
    """The shapes of the weights and biases of the conv, batch-norm and linear layers, in
    forward order (every conv has a bias; batch norm has a scale and a shift)."""
    shapes = []
    for layer in layers:
        if layer.op in ("conv2d", "linear"):
            shapes += [layer.w, layer.w[:1]]
        elif layer.op.startswith("batch_norm"):
            shapes += [layer.x[1:2]] * 2
    return shapes


def parameter_count(layers):
    return sum(math.prod(shape) for shape in parameter_shapes(layers))


def resnet18_layers(batch=BATCH, width=64, image=IMAGE, in_channels=1, classes=CLASSES):
    """Every op call of one training step of nn.resnet18(classes, in_channels, width) on a batch
    of (batch, image, image) uint8 images, forward order, then the optimizer's update."""
    layers = [Layer("images_to_float", "input", (batch, image, image))]
    x = _conv(layers, "0", (batch, in_channels, image, image), width, 3, 1, 1)
    layers.append(Layer("batch_norm_relu", "1", x))   # the relu "2" runs inside the norm (nn.Sequential)
    for stage in range(1, 5):
        channels = width * 2 ** (stage - 1)
        for block in range(2):
            stride = 2 if stage > 1 and block == 0 else 1
            x = _residual(layers, f"resnet_block{stage}.{block}", x, channels, stride)
    layers.append(Layer("global_avg_pool", "global_avg_pool", x))
    x = x[:2]
    layers.append(Layer("linear", "fc.1", x, (classes, x[1])))
    layers.append(Layer("softmax_cross_entropy", "loss", (batch, classes)))
    layers.append(Layer("sgd_update", "optimizer", (parameter_count(layers),)))
    return layers


def _conv(layers, name, x, channels, kernel, stride, padding):
    layer = Layer("conv2d", name, x, (channels, x[1], kernel, kernel), stride, padding)
    layers.append(layer)
    return layer.y


def _residual(layers, name, x, channels, stride):
    """nn.resnet.Residual: conv1, bn1 with its relu, conv2, the 1x1 projection conv3 where the
    shape changes, and bn2 with the join relu(bn2 + shortcut)."""
    y = _conv(layers, f"{name}.conv1", x, channels, 3, stride, 1)
    layers.append(Layer("batch_norm_relu", f"{name}.bn1", y))
    y = _conv(layers, f"{name}.conv2", y, channels, 3, 1, 1)
    if stride != 1 or x[1] != channels:
        _conv(layers, f"{name}.conv3", x, channels, 1, stride, 0)
    layers.append(Layer("batch_norm_add_relu", f"{name}.bn2", y))
    return y


def distinct(layers, key=lambda layer: layer.key):
    """[(layer, count)]: the first layer of each distinct key (Layer.key, or `key(layer)`) and how many
    layers share it."""
    counts = Counter(key(layer) for layer in layers)
    first = {}
    for layer in layers:
        first.setdefault(key(layer), layer)
    return [(layer, counts[k]) for k, layer in first.items()]
