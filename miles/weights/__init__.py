"""The weight wire formats both planes share: what a trainer sends and an engine reads.

:mod:`miles.weights.wire`: safetensors bytes for ``/update_weights_from_tensor`` and a broadcast group
for ``/update_weights_from_distributed``; :mod:`miles.weights.shm`: the shared-memory weight file of the
``shm`` transport; :mod:`miles.weights.delta`: the delta pushes' blocks and checksums. None imports the engine or
the trainer.
"""
