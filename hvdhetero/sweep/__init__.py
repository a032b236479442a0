"""Hyper-parameter sweeps across the inventory's hosts (issue 31), launcher side: the space file
(space.py). Torch-free, like cluster/."""
