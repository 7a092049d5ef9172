from . import functional  # noqa: F401
from .functional import InterpolationMode  # noqa: F401


def __getattr__(name):
    from torchvision._unavailable import unavailable

    return unavailable(f"torchvision.transforms.{name}")
