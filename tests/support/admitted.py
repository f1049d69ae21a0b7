"""Every request the engine admits, as the scheduler receives it (its Admit: the prompt's ids
once measured, the sampling with max tokens sized), spied on the scheduler's mailbox.

    admitted = Admitted(served.engine, monkeypatch)
    ... requests ...
    [admit] = admitted.take()
"""

from __future__ import annotations

from typing import Any

import pytest

from shoal.actors.messages import Admit
from shoal.api.engine import Engine


class Admitted:
    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.admits: list[Admit] = []
        box = engine.actors.scheduler_box
        put = box.put

        def spy(msg: Any) -> None:
            if isinstance(msg, Admit):
                self.admits.append(msg)
            put(msg)

        monkeypatch.setattr(box, "put", spy)

    def take(self) -> list[Admit]:
        """The admits since the last take."""
        taken, self.admits = self.admits, []
        return taken
