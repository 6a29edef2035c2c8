"""Example training scripts, runnable with ``python -m`` or ``torchrun -m``."""
