"""MoK-Py core: config, float64 reference, schedule builder and compute kernels (no framework)."""
from .config import PRESETS, LayerShape, MoKConfig, preset
from .errors import MoKError

__all__ = ["LayerShape", "MoKConfig", "MoKError", "PRESETS", "preset"]
__version__ = "0.1.0"
