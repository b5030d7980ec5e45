"""A test env for runs that must be stopped with sandboxes open: its ``reset`` runs one command in the
trajectory's sandbox (so the sandbox exists) and then waits for ever. Loaded by import path
(``rollout.env.name=held_env:HeldEnv``) from a ``miles train`` subprocess whose PYTHONPATH has this folder."""

import asyncio


class HeldEnv:
    """Opens its trajectory's sandbox, then holds the trajectory until the run is stopped."""

    tools: list = []

    def __init__(self, ctx, **config):
        self.ctx = ctx

    async def reset(self, sample):
        result = await self.ctx.sandbox.run("echo open", timeout_s=60)
        assert result.stdout == "open\n", result
        await asyncio.Event().wait()

    async def step(self, action):
        raise AssertionError("a held trajectory takes no step")

    async def close(self):
        pass
