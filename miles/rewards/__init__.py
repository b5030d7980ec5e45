"""The builtin reward library: ``exact_match``, ``env``, ``math``, ``multiple_choice``, ``f1``, ``format`` and
``code_tests``; and how a step scores its samples with the run's reward (:mod:`miles.rewards.scoring`).

Each reward is registered by :mod:`miles.builtin.rewards`; this package holds their implementations,
one module each. Importing it is cheap: the math verifier runs in a process of its own and the code
tests in the sandbox, so neither sympy nor a sandbox is loaded until a reward needs it.
"""

from miles.rewards.code_tests import CodeTests
from miles.rewards.format import FormatReward
from miles.rewards.math_answer import extract_answer, math_reward
from miles.rewards.multiple_choice import extract_choice, multiple_choice
from miles.rewards.simple import env, exact_match
from miles.rewards.token_f1 import token_f1

__all__ = ["CodeTests", "FormatReward", "env", "exact_match", "extract_answer", "extract_choice", "math_reward",
           "multiple_choice", "token_f1"]
