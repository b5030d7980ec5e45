import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from standin_modal import StandInModal  # noqa: E402

torch.set_num_threads(1)

from miles.testing import chat_model_dir, tiny_model_dir  # noqa: E402,F401  (the fixtures)


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The STAND-IN for Modal's service (tests/standin_modal.py) in place of the SDK's calls, with made-up
    credentials; at the end no sandbox may be open, here or there. Its sandboxes run in bubblewrap."""
    from miles.agentic.sandboxes.local import bwrap_problem
    from miles_modal import ModalSandbox

    if bwrap_problem() is not None:
        pytest.skip(f"the Modal stand-in runs commands with bubblewrap: {bwrap_problem()}")

    service = StandInModal(tmp_path / "modal-standin")
    service.install(monkeypatch.setattr)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-standin")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-standin")
    monkeypatch.delenv("MODAL_SERVER_URL", raising=False)  # messages name the SDK's default server
    yield service
    assert not ModalSandbox._live, "a sandbox was left open in this process"
    assert service.live() == [], "the stand-in still holds sandboxes"
