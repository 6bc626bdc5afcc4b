"""The autograd and everything built on it, with PyTorch's names."""
from . import functional, init
from .hooks import register_module_hook
from .init import manual_seed
from .modules import (AdaptiveAvgPool2d, BatchNorm2d, Conv2d, FlatParameters, Flatten, Linear,
                      MaxPool2d, Module, Parameter, ReLU, Sequential)
from .optim import SGD, CosineAnnealingLR
from .resnet import Residual, resnet18
from .serialization import SerializationError, load_safetensors, save_safetensors
from .tensor import Tensor, is_grad_enabled, no_grad
