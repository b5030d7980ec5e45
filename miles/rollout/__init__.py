"""The rollout plane: data source, rollout functions, engine access and the reward stage."""

from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt, PromptSource
from miles.rollout.single_turn import apply_generate_answer

__all__ = ["Prompt", "PromptSource", "RolloutContext", "apply_generate_answer"]
