"""A torch backend whose checkpoint write can be held (for tests/test_checkpoint.py): a test stops a real
``miles train`` process at a chosen moment inside a checkpoint write, without guessing at timing.

``backend.name=checkpoint_gate:GatedBackend`` (``tests/`` on PYTHONPATH) with ``backend.gate_dir=DIR``: the
``hold_call``-th ``save_checkpoint`` of the run writes ``DIR/held`` (holding the folder it writes into) at the
moment ``hold_at`` (``start``: before the backend wrote anything; ``end``: after it wrote all of its files), then
waits until ``DIR/release`` exists, or with ``until=given_up`` until the checkpoint's folder is gone (the run gave
the write up and removed it), and writes ``DIR/wrote`` once its files are written. The checkpoint's hidden folder
exists at both moments. Without ``gate_dir`` it is the torch backend.
"""

import time
from pathlib import Path

from miles.train.torch_backend import TorchBackend

MOMENTS = ("start", "end")


class GatedBackend(TorchBackend):
    def __init__(self, gate_dir: str = "", hold_call: int = 1, hold_at: str = "start", until: str = "release",
                 **kwargs):
        super().__init__(**kwargs)
        if hold_at not in MOMENTS or until not in ("release", "given_up"):
            raise ValueError(f"hold_at: one of {MOMENTS}, got {hold_at!r}; until: release or given_up, got {until!r}")
        self.gate_dir, self.hold_call, self.hold_at, self.until, self.calls = gate_dir, hold_call, hold_at, until, 0

    def save_checkpoint(self, path: str) -> None:
        self.calls += 1
        held = bool(self.gate_dir) and self.calls == self.hold_call
        if held and self.hold_at == "start":
            self._hold(path)
        super().save_checkpoint(path)
        if held:
            (Path(self.gate_dir) / "wrote").touch()
        if held and self.hold_at == "end":
            self._hold(path)

    def _hold(self, path: str) -> None:
        gate, folder = Path(self.gate_dir), Path(path).parent  # path: the checkpoint's backend/
        (gate / "held").write_text(path)
        # a gate, not a timer: the test opens it, the run removes the folder, or the run is killed
        while not (gate / "release").exists() and not (self.until == "given_up" and not folder.exists()):
            time.sleep(0.01)
