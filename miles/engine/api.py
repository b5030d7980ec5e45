"""What a rollout-engine plugin needs from Miles, in one place (``from miles.engine import api``).

A server-launcher plugin (``miles-sglang``, your own; the contract is ``miles_register_rollout_engines`` in
:mod:`miles.hookspecs`) imports only this module, ``miles`` and ``miles.testing``:

- :class:`SubprocessLauncher`: the base of a launcher whose server is a command run in a process group of its
  own (start, wait until it answers, stop, a log to report);
- :func:`is_server_launcher`: whether a registered rollout engine is a server launcher;
- :class:`SpeculativeConfig`: ``rollout.engine.speculative`` parsed and checked (:mod:`miles.engine.speculative`);
  :func:`mtp_head_names`: the tensors of the MTP head a checkpoint ships (``draft: mtp``, :mod:`miles.models.mtp`);
- errors: :class:`ConfigError` (bad engine arguments, exit code 2), :class:`RunError` (a server that failed).
"""

from miles.engine.launchers import SubprocessLauncher
from miles.engine.speculative import SpeculativeConfig
from miles.errors import ConfigError, RunError
from miles.hookspecs import is_server_launcher

__all__ = ["ConfigError", "RunError", "SpeculativeConfig", "SubprocessLauncher", "is_server_launcher",
           "mtp_head_names"]


def mtp_head_names(model_path: str) -> dict[str, str]:
    """The names of the MTP head's tensors in the checkpoint at ``model_path`` (empty: it ships none); see
    :func:`miles.models.mtp.head_names`. Imports torch only when called."""
    from miles.models.mtp import head_names

    return head_names(model_path)
