"""Shared pytest configuration: tests run on the CPU with few threads."""

from __future__ import annotations

import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
