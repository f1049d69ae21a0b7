"""What the weight-push tests share: a checkpoint's tensors by name, and a trainer process
(weight_trainer.py) that broadcasts them over a gloo group it hosts."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TRAINER = Path(__file__).parents[2] / "bench" / "weight_trainer.py"


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    named: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        named.update(load_file(file))
    return named


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Trainer:
    def __init__(self, folder: Path, mode: str, group: str = "weight_update_group") -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, str(TRAINER), str(self.port), str(folder), mode, "1", group],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def listening(self) -> bool:
        """Its rendezvous store takes connections (the trainer hosts it as rank 0)."""
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def specs(folder: Path) -> tuple[list[str], list[str], list[list[int]]]:
    named = sorted(checkpoint(folder).items())
    names = [name for name, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]  # as slime sends them
    return names, dtypes, [list(t.shape) for _, t in named]
