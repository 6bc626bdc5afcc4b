"""ResNet-18 with the module tree of d2l's PyTorch version (the 'multiple GPUs,
concise' section), so that state-dict keys line up with it."""
from kernels.cuda.launch import ELEMENT_LIMIT
from .init import get_rng_state, init_model, set_rng_state
from .modules import AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Flatten, Linear, Module, ReLU, Sequential


class Residual(Module):
    """Two 3x3 convs with batch norm; a 1x1 projection ``conv3`` when the shape changes. The relu
    after bn1 and the join relu(bn2 + shortcut) are fused into the batch norms, and in training
    each norm's statistics into the convolution before it, and bn1 with its relu into conv2, which
    applies them as it loads its input where it can (F.batch_norm's fold)."""

    def __init__(self, in_channels, channels, use_1x1conv=False, stride=1):
        super().__init__()
        self.conv1 = Conv2d(in_channels, channels, 3, stride=stride, padding=1)
        self.conv2 = Conv2d(channels, channels, 3, padding=1)
        self.conv3 = Conv2d(in_channels, channels, 1, stride=stride) if use_1x1conv else None
        self.bn1 = BatchNorm2d(channels)
        self.bn2 = BatchNorm2d(channels)

    def forward(self, x):
        # each convolution computes the statistics of the batch norm after it, where its output is, and the
        # backward sums of the norm before it, where its dx is (F.conv2d: bn1's in conv2, and the previous
        # block's bn2's in whichever of conv1 and conv3 runs its backward last)
        y = self.bn1(self.conv1(x, self.bn1.statistics_request()), relu=True, fold=True)
        y = self.conv2(y, self.bn2.statistics_request())
        shortcut = self.conv3(x) if self.conv3 is not None else x
        return self.bn2(y, residual=shortcut)


def _stage(in_channels, channels, first):
    """Two residual blocks; all but the first stage halve the resolution."""
    if first:
        return Sequential(Residual(channels, channels), Residual(channels, channels))
    return Sequential(Residual(in_channels, channels, use_1x1conv=True, stride=2),
                      Residual(channels, channels))


def resnet18(num_classes=10, in_channels=1, width=64, init="normal"):
    """ResNet-18 for small images: a 3x3 stem without max-pool, four stages of
    ``width``, 2x, 4x and 8x ``width`` channels, global average pool, linear.
    ``init`` is 'normal' (N(0, 0.01) weights, zero biases) or 'pytorch'."""
    if width < 1 or num_classes < 1 or in_channels < 1:
        raise ValueError(f"resnet18 needs positive sizes, got num_classes={num_classes}, "
                         f"in_channels={in_channels}, width={width}")
    w = width
    net = Sequential(Conv2d(in_channels, w, 3, stride=1, padding=1), BatchNorm2d(w), ReLU())
    net.add_module("resnet_block1", _stage(w, w, first=True))
    net.add_module("resnet_block2", _stage(w, 2 * w, first=False))
    net.add_module("resnet_block3", _stage(2 * w, 4 * w, first=False))
    net.add_module("resnet_block4", _stage(4 * w, 8 * w, first=False))
    net.add_module("global_avg_pool", AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", Sequential(Flatten(), Linear(8 * w, num_classes)))
    return init_model(net, init)


def parameter_count(width, num_classes=10, in_channels=1):
    """The parameters of ``resnet18(num_classes, in_channels, width)``, without making it (a width
    too large for memory, say): a quadratic in the width (the convolutions' weights grow with its
    square; biases, batch norms and the classifier with it) through three tiny models, exactly; the
    seeded generator is left as it was."""
    state = get_rng_state()
    try:
        f1, f2, f3 = (sum(p.size for p in resnet18(num_classes, in_channels, w).parameters()) for w in (1, 2, 3))
    finally:
        set_rng_state(state)
    return f1 + (f2 - f1) * (width - 1) + (f3 - 2 * f2 + f1) * (width - 1) * (width - 2) // 2


def largest_activation(width, size=28):
    """Elements per image of ``resnet18(width=width)``'s largest activation on ``size`` x ``size`` images:
    the stem's and the first stage's, ``width`` channels at the input's resolution."""
    return width * size * size


def largest_gpu_batch(width, size=28):
    """The most images of ``size`` x ``size`` whose first-stage activations at ``width`` the CUDA kernels can
    index (their int indices: kernels/cuda/launch.py's ELEMENT_LIMIT, which checks every launch too)."""
    return ELEMENT_LIMIT // largest_activation(width, size)


# what the model holds per parameter: its value, its gradient and its momentum, each float32, and as much
# again while it is made (each layer's arrays, then the flat buffers they are copied into)
MODEL_BYTES_PER_PARAMETER = 4 * 5


def memory_shortfall(width, num_classes, in_channels, xp):
    """Why ``resnet18(num_classes, in_channels, width)`` cannot be made and trained on ``xp``'s device,
    in words, asked before it is made: its parameters alone do not fit in the host's available
    memory or, on a GPU, in the device's (activations come on top); None when they fit."""
    count = parameter_count(width, num_classes, in_channels)
    need = count * MODEL_BYTES_PER_PARAMETER
    places = [("the host", _host_memory())]
    if xp.__name__ != "numpy":
        device = xp.cuda.runtime.getDevice()
        places.append((f"GPU {device}", xp.cuda.runtime.getDeviceProperties(device)["totalGlobalMem"]))
    for place, have in places:
        if have is not None and need > have:
            return (f"--width {width}: the model has {count:,} parameters, {need / 2**30:,.1f} GiB with their "
                    f"gradients and momentum, more than the {have / 2**30:,.1f} GiB {place} has")
    return None


def _host_memory():
    """Bytes of memory the host has available now (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
