"""An env for the Ctrl-C test: its reset starts a long command in the trajectory's sandbox, so a run holds its
sandboxes open until it is stopped. It takes the arguments of configs/retool.yaml's ``tool_env``."""

from miles import StepResult


class HoldingEnv:
    def __init__(self, ctx, tools=(), tool_timeout_s: float = 10.0):
        self.ctx, self.tools = ctx, []

    async def reset(self, sample):
        await self.ctx.sandbox.run("sleep 600", timeout_s=900)

    async def step(self, action):
        return StepResult(done=True)

    async def close(self):
        pass
