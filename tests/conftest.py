import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCRIPTS = ["ppo_cartpole_gpu", "vpg", "reinforce"]
"""The scripts that share the tensor CartPole, the CLI skeleton and summary.json."""

# Two threads at most: CI machines have two cores, and small ops get slower with more.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty folder so runs/ is written there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
