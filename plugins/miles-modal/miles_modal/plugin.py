"""Entry point of the ``miles-modal`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_sandboxes(register):
    register("modal", "miles_modal.sandbox:ModalSandbox")
