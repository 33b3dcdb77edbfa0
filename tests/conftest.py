"""Shared test setup.

The CPU suite runs kernels under numba's CUDA simulator; the variable must be set before numba
is imported, so a machine without a GPU gets it here even when pytest is run by hand.
"""
import os
import sys

if "NUMBA_ENABLE_CUDASIM" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "ptx"))
