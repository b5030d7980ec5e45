"""The README's examples work: its environment plays in process and behind its server, and its two configs
pass Miles' config validation (``miles config``), while a broken one exits 2 naming the argument."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles import Action, EnvContext, Sample, ToolCall
from miles_openenv import OpenEnvEnv

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


@pytest.fixture
def readme_modules(tmp_path, monkeypatch):
    """The README's Python files (``# name.py`` on their first line), written to ``tmp_path`` and importable."""
    for block in blocks("python"):
        name = block.splitlines()[0].removeprefix("# ")
        (tmp_path / name).write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def env_nodes() -> tuple[dict, dict]:
    """The env nodes of the README's configs: in process, remote."""
    local, remote = (yaml.safe_load(block)["rollout"]["env"] for block in blocks("yaml"))
    return local, remote


async def guess_until_done(env: OpenEnvEnv, secret: int) -> tuple[float, int]:
    """Bisect with the ``guess`` tool: the reward and the number of guesses."""
    low, high, guesses = 1, 100, 0
    try:
        await env.reset(Sample(prompt="", prompt_ids=[0], metadata={"data": {"prompt": "", "secret": secret}}))
        while True:
            guess = (low + high) // 2
            guesses += 1
            result = await env.step(Action("", [ToolCall("guess", {"number": guess}, id=str(guesses))]))
            if result.done:
                return result.reward, guesses
            hint = result.observation[0]["content"]
            low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
    finally:
        await env.close()


def test_the_readme_environment_plays_in_process_and_behind_its_server(readme_modules, start_server):
    import guess_server

    server = start_server(make_app=lambda: guess_server.app)
    local, remote = env_nodes()
    local_env = OpenEnvEnv(EnvContext(), **{k: v for k, v in local.items() if k != "name"})
    remote_env = OpenEnvEnv(EnvContext(), **{k: v for k, v in remote.items() if k != "name"} | {"base_url": server.url})
    assert asyncio.run(guess_until_done(local_env, 37)) == (1.0, 3)
    assert asyncio.run(guess_until_done(remote_env, 37)) == (1.0, 3)
    assert local_env.tools == remote_env.tools and local_env.tools[0]["function"]["name"] == "guess"


def test_the_readme_configs_validate(readme_modules):
    """``miles config`` accepts the in-process config and refuses the remote one with ``env`` added (exit 2);
    the remote config's env node passes the same checks here."""
    data = readme_modules / "train.jsonl"
    # a prompt the default model's tokenizer encodes (the configs name no model; letters would be refused)
    data.write_text(json.dumps({"prompt": "1+1=", "secret": 37}) + "\n")
    local, remote = (readme_modules / "local.yaml", readme_modules / "remote.yaml")
    for path, block in zip((local, remote), blocks("yaml")):
        path.write_text(block)
    env = {**os.environ, "PYTHONPATH": str(readme_modules), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    runs = [[str(local)], [str(remote), "rollout.env.env=guess_env:GuessNumber"]]
    processes = [subprocess.Popen([sys.executable, "-m", "miles", "config", *args, f"data.train_path={data}",
                                   "run.plugins.allow=[openenv]"], env=env, cwd=readme_modules,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in runs]
    (_, accepted), (_, refused) = (p.communicate(timeout=600) for p in processes)
    assert processes[0].returncode == 0, accepted
    assert processes[1].returncode == 2, refused
    assert "rollout.env: env 'openenv' rejected its arguments: env, base_url: set exactly one" in refused
    OpenEnvEnv.check_args({k: v for k, v in env_nodes()[1].items() if k != "name"})
