"""Miles plugin for NeMo Gym: its resources servers as the env ``nemo_gym`` (:mod:`miles_nemo_gym.env`), its
agent servers as rollouts of Miles' ``agent`` rollout function (:mod:`miles_nemo_gym.agent`), and a venv of the
pinned ``nemo-gym`` to run its servers in (:mod:`miles_nemo_gym.venv`, :mod:`miles_nemo_gym.servers`)."""
