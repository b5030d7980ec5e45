"""The core loop: the step's stages, the learner, the schedules, evaluation and distillation."""
