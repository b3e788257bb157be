"""Trace-driven replay of policy stacks on a hardware model: CPU, GPU and PCIe timelines per MoE layer."""

from .replay import SimResult, simulate
from .stacks import STACKS, Stack

__all__ = ["STACKS", "SimResult", "Stack", "simulate"]
