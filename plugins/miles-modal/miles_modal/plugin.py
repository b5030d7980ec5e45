"""Entry point of the ``miles-modal`` plugin (group ``miles``)."""

import miles
from miles_modal.sandbox import ModalSandbox


@miles.hookimpl
def miles_register_sandboxes(register):
    register("modal", ModalSandbox)
