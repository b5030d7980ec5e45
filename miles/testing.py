"""Helpers and pytest fixtures for plugin authors (and Miles' own tests).

Use the fixtures with ``pytest_plugins = ["miles.testing"]`` in a ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from miles.config.schema import ModelBuildConfig, TokenizerConfig
from miles.models.hf import build_model_dir
from miles.plugins import build_plugin_manager
from miles.registry import Registry
from miles.types import Sample, SampleStatus

try:  # the fixtures and conformance suites need pytest; the helpers (serve_engine, make_train_batch, ...) do not
    import pytest
    fixture = pytest.fixture
except ImportError:  # pragma: no cover - exercised by a subprocess test without pytest
    pytest = None

    def fixture(*args: Any, **kwargs: Any) -> Any:
        """Without pytest a fixture is a plain function (``@fixture`` and ``@fixture(...)`` both work)."""
        return args[0] if args and callable(args[0]) else (lambda fn: fn)

if TYPE_CHECKING:
    from miles.types import TrainBatch

__all__ = [
    "BackendConformance", "build_chat_model", "build_tiny_model", "chat_model_dir", "make_registry", "make_sample", "make_train_batch", "tiny_model_dir",
    "miles_registry", "MILES_WITH_CTRL_C", "SandboxConformance", "EnvConformance", "ScriptedPolicy", "CHAT_ALPHABET",
    "CHAT_TOKENIZER", "serve_engine", "serve_in_thread",
]

# The `miles` command line, to run with subprocess, with Ctrl-C restored: a shell without job control starts
# background commands with SIGINT ignored and a child inherits that, so a test that sends SIGINT uses this.
MILES_WITH_CTRL_C = [sys.executable, "-c", "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "runpy.run_module('miles', run_name='__main__')"]

@contextlib.contextmanager
def serve_engine(model_dir: str | Path, *args: str, timeout_s: float = 120.0) -> Iterator[str]:
    """``miles engine serve`` for ``model_dir`` in a process of its own on a free 127.0.0.1 port (one torch
    thread), started by the ``miles_server`` launcher; yields its base URL once ``/health`` answers, and stops
    the process (and removes its log) on exit. ``args``: more ``miles engine serve`` flags."""
    from miles.engine.launchers import MilesServerLauncher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = MilesServerLauncher(extra_args=list(args), startup_timeout_s=timeout_s)
    try:
        yield launcher.start(str(model_dir), host="127.0.0.1", port=port, admin_token="", threads=1)
    finally:
        launcher.stop()
        if launcher.log_path:
            Path(launcher.log_path).unlink(missing_ok=True)


@contextlib.contextmanager
def serve_in_thread(engine: Any) -> Iterator[str]:
    """``engine``'s HTTP application (:func:`miles.engine.server.build_app`) on a free 127.0.0.1 port, served
    by a thread of this process (so that a test can patch what it runs); yields its base URL."""
    import asyncio
    import threading

    from aiohttp import web

    from miles.engine.server import build_app

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(engine))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


ADDITION_ALPHABET = "0123456789+="
# Every printable ASCII character and a newline: enough for chat templates, JSON tool calls and Python code.
CHAT_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
CHAT_TOKENIZER = {"special_tokens": ["<|im_start|>", "<|im_end|>"],
                  "added_tokens": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
                  "chat_template": "chatml_tools"}


def build_tiny_model(path: str | Path, alphabet: str = ADDITION_ALPHABET, seed: int = 0,
                     tokenizer: dict[str, Any] | None = None, **build: Any) -> Path:
    """A random-init Qwen3 model (hidden 64, 2 layers unless overridden) with a char tokenizer
    (``tokenizer``: more fields of ``model.tokenizer``, e.g. ``special_tokens`` and ``chat_template``)."""
    build_cfg = OmegaConf.merge(OmegaConf.structured(ModelBuildConfig), build)
    tokenizer_cfg = OmegaConf.structured(TokenizerConfig(alphabet=alphabet, **(tokenizer or {})))
    return build_model_dir(build_cfg, tokenizer_cfg, path, seed)


def make_registry(*plugins: object, autoload: bool = False) -> Registry:
    """A registry of the builtins plus ``plugins`` (modules or objects with ``@hookimpl`` methods)."""
    pm = build_plugin_manager(autoload=autoload, extra_plugins=[(f"test-plugin-{i}", p) for i, p in enumerate(plugins)])
    return Registry.from_plugin_manager(pm)


def make_sample(response_text: str = "", label: Any = None, **fields: Any) -> Sample:
    """A completed sample for testing rewards and selectors."""
    fields.setdefault("prompt_ids", [0])
    fields.setdefault("status", SampleStatus.COMPLETED)
    return Sample(response_text=response_text, label=label, **fields)


def build_chat_model(path: str | Path, seed: int = 0, **build: Any) -> Path:
    """A tiny model whose char tokenizer covers printable ASCII, with ChatML special tokens, the Hermes tool
    tokens and the shipped ``chatml_tools`` chat template."""
    build.setdefault("max_position_embeddings", 512)
    return build_tiny_model(path, CHAT_ALPHABET, seed, tokenizer=CHAT_TOKENIZER, **build)


@fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a chat template (:func:`build_chat_model`), built once per test session."""
    return build_chat_model(tmp_path_factory.mktemp("miles-chat-model") / "model")


@fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF-format model directory, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("miles-tiny-model") / "model")


@fixture
def miles_registry() -> Registry:
    """A registry of the builtins only (no installed plugins)."""
    return make_registry()


def make_train_batch(seed: int = 0, rows: int = 6, group_size: int = 3) -> "TrainBatch":
    """A small GRPO batch of varied lengths over the addition alphabet, advantages filled in."""
    import torch

    from miles.builtin.advantages import grpo
    from miles.types import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        n = 2 + i % 3
        samples.append(Sample(
            prompt_ids=[4, 13, 5 + i % 2, 14], group_index=i // group_size, status=SampleStatus.COMPLETED,
            response_ids=torch.randint(3, 14, (n,), generator=gen).tolist(), loss_mask=[1] * n,
            rollout_logprobs=[-2.0] * n, reward=float(i % 2),
        ))
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = grpo(batch)
    return batch


def _approx(value: float, abs: float) -> Any:
    return value if abs == 0 else pytest.approx(value, abs=abs)


class BackendConformance:
    """The contract every training backend keeps. Subclass it in a test module of your backend:

        class TestMyBackend(BackendConformance):
            def make_backend(self, **split):
                return MyBackend(lr=1e-3, **split)

            split_options = ({"micro_batch_size": 6}, {"micro_batch_size": 2})  # or None

    and pytest runs every check below against it (with ``pytest_plugins = ["miles.testing"]``).
    """

    split_options: tuple[dict, ...] | None = None
    resume_tolerance: float = 0.0  # 0: a resumed step is bitwise the uninterrupted one

    def make_backend(self, **split: Any) -> Any:
        raise NotImplementedError

    @fixture(autouse=True)
    def _shut_down_backends(self):
        self._made: list[Any] = []
        yield
        for backend in self._made:
            backend.shutdown()

    def _ready(self, model_dir: Path, ref: bool = False, **split: Any) -> Any:
        backend = self.make_backend(**split)
        self._made.append(backend)
        backend.setup(str(model_dir), seed=0, **({"ref_model_path": str(model_dir)} if ref else {}))
        return backend

    def _step(self, model_dir: Path, batch: Any, loss_fn: Any, **split: Any) -> dict[str, float]:
        """One step on a fresh backend, shut down afterwards (only one holds workers at a time)."""
        backend = self._ready(model_dir, **split)
        metrics = backend.train_step(batch, loss_fn)
        backend.shutdown()
        return metrics

    def test_step_metrics_include_the_required_figures(self, tiny_model_dir: Path) -> None:
        from miles.builtin.losses import ppo_clip

        backend = self._ready(tiny_model_dir)
        metrics = backend.train_step(make_train_batch(), ppo_clip)
        required = {"train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/clip_frac",
                    "train/rollout_logprob_abs_diff", "train/lr"}
        assert required <= set(metrics), sorted(required - set(metrics))
        backend.shutdown()

    def test_logprobs_match_a_transformers_forward(self, tiny_model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        batch = make_train_batch()
        backend = self._ready(tiny_model_dir, ref=True)
        logprobs, ref = backend.compute_logprobs(batch), backend.ref_logprobs(batch)
        backend.shutdown()
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids).logits[:, :-1].float()
        expected = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        mask = batch.loss_mask.bool()
        assert logprobs.shape == ref.shape == batch.loss_mask.shape
        assert torch.allclose(logprobs[mask], expected[mask], atol=1e-4)
        assert torch.allclose(ref[mask], expected[mask], atol=1e-4)

    def test_resuming_from_a_checkpoint_repeats_the_next_step(self, tiny_model_dir: Path, tmp_path: Path) -> None:
        from miles.builtin.losses import ppo_clip

        first, second = make_train_batch(seed=1), make_train_batch(seed=2)
        backend = self._ready(tiny_model_dir)
        backend.train_step(first, ppo_clip)
        (tmp_path / "ckpt").mkdir()
        backend.save_checkpoint(str(tmp_path / "ckpt"))
        expected = backend.train_step(second, ppo_clip)
        expected_weights = backend.export_weights()
        backend.shutdown()
        resumed = self._ready(tiny_model_dir)
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        again = resumed.train_step(second, ppo_clip)
        for key in ("train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/lr"):
            assert again[key] == _approx(expected[key], abs=self.resume_tolerance), key
        for name, tensor in resumed.export_weights().items():
            assert (tensor - expected_weights[name]).abs().max() <= self.resume_tolerance, name
        resumed.shutdown()

    def test_train_step_reports_metrics_and_changes_weights(self, tiny_model_dir: Path) -> None:
        import math

        import torch

        from miles.builtin.losses import ppo_clip

        backend = self._ready(tiny_model_dir)
        before = {k: v.clone() for k, v in backend.export_weights().items()}
        metrics = backend.train_step(make_train_batch(), ppo_clip)
        assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])
        after = backend.export_weights()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        backend.shutdown()

    def test_exported_weights_match_the_hf_model(self, tiny_model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        backend = self._ready(tiny_model_dir)
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        exported = backend.export_weights()
        assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in reference.items()}
        backend.shutdown()

    def test_save_pretrained_loads_with_transformers(self, tiny_model_dir: Path, tmp_path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from miles.builtin.losses import ppo_clip

        backend = self._ready(tiny_model_dir)
        backend.train_step(make_train_batch(), ppo_clip)
        backend.save_pretrained(str(tmp_path / "out"), AutoTokenizer.from_pretrained(tiny_model_dir), {"step": 1})
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
        for name, tensor in backend.export_weights().items():
            assert torch.equal(loaded[name], tensor.cpu()), name
        assert (tmp_path / "out" / "miles.json").is_file()
        backend.shutdown()

    def test_same_seed_same_step(self, tiny_model_dir: Path) -> None:
        from miles.builtin.losses import ppo_clip

        first, second = (self._step(tiny_model_dir, make_train_batch(), ppo_clip) for _ in range(2))
        assert first["train/loss"] == second["train/loss"] and first["train/grad_norm"] == second["train/grad_norm"]

    def test_how_the_batch_is_split_does_not_change_the_step(self, tiny_model_dir: Path) -> None:
        import pytest as _pytest

        from miles.builtin.losses import ppo_clip

        if not self.split_options:
            _pytest.skip("this backend declares no split options")
        results = [self._step(tiny_model_dir, make_train_batch(), ppo_clip, **split) for split in self.split_options]
        for other in results[1:]:
            assert other["train/loss"] == _pytest.approx(results[0]["train/loss"], abs=1e-5)
            assert other["train/grad_norm"] == _pytest.approx(results[0]["train/grad_norm"], rel=1e-5)


class SandboxConformance:
    """The contract every sandbox keeps. Subclass it in a test module of your sandbox plugin:

        class TestMySandbox(SandboxConformance):
            isolated = True  # False skips the network and filesystem isolation checks

            def make_sandbox(self):
                return MySandbox(...)

    Each check opens a fresh sandbox, runs commands in it with ``asyncio.run`` and closes it. The checks
    that look for leftover processes look at this machine's ``/proc``, so for a remote sandbox they pass
    trivially.
    """

    isolated: bool = True

    def make_sandbox(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def pids_running(marker: str) -> list[int]:
        """Processes on this machine whose command line contains ``marker`` (zombies have none)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if marker in cmdline:
                    pids.append(int(entry.name))
        return pids

    @staticmethod
    def wait_until_gone(marker: str, timeout_s: float = 30.0) -> list[int]:
        """Poll until no process on this machine has ``marker`` in its command line; what is left then."""
        import time

        deadline = time.monotonic() + timeout_s
        while (left := SandboxConformance.pids_running(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    @staticmethod
    def unique_sleep() -> str:
        """A ``sleep`` command line no other process has, to find its process by (``sleep 1000.<digits>``)."""
        import random

        return f"sleep 1000.{random.randrange(10**8):08d}"

    def _with_sandbox(self, body: Any) -> Any:
        """``await body(sandbox)`` on a fresh sandbox, closed afterwards."""
        import asyncio

        async def main() -> Any:
            sandbox = self.make_sandbox()
            try:
                return await body(sandbox)
            finally:
                await sandbox.close()

        return asyncio.run(main())

    def _run(self, command: str, timeout_s: float = 30, **kwargs: Any) -> Any:
        return self._with_sandbox(lambda sandbox: sandbox.run(command, timeout_s=timeout_s, **kwargs))

    def _skip_unless_isolated(self) -> None:
        if not self.isolated:
            pytest.skip("this sandbox declares no isolation (isolated = False)")

    def test_echo(self) -> None:
        result = self._run("echo hello sandbox")
        assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("hello sandbox\n", "", 0, False)
        assert result.duration_s >= 0

    def test_stderr_is_captured(self) -> None:
        result = self._run("echo oops >&2; echo out")
        assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "oops\n", 0)

    def test_exit_codes(self) -> None:
        async def body(sandbox: Any) -> list[int]:
            return [(await sandbox.run(command, timeout_s=30)).exit_code for command in ("true", "exit 3", "false")]

        assert self._with_sandbox(body) == [0, 3, 1]

    def test_files_are_written_into_the_workspace_and_kept_between_runs(self) -> None:
        blob = bytes(range(256)) * 4

        async def body(sandbox: Any) -> tuple[Any, Any]:
            first = await sandbox.run("cat a.txt; wc -c < data/blob.bin; echo made > made.txt", timeout_s=30,
                                      files={"a.txt": b"hi\n", "data/blob.bin": blob})
            second = await sandbox.run("cat made.txt a.txt; cmp data/blob.bin data/copy.bin && echo same", timeout_s=30,
                                       files={"data/copy.bin": blob})
            return first, second

        first, second = self._with_sandbox(body)
        assert (first.stdout.split(), first.exit_code) == (["hi", "1024"], 0)
        assert (second.stdout, second.exit_code) == ("made\nhi\nsame\n", 0)

    def test_a_timeout_kills_the_command(self) -> None:
        import time

        started = time.monotonic()
        result = self._run("sleep 30", timeout_s=1)
        assert result.timed_out and result.exit_code is None
        assert time.monotonic() - started < 20

    def test_output_is_capped(self) -> None:
        result = self._run("head -c 10000000 /dev/zero | tr '\\0' x")
        assert result.exit_code == 0 and not result.timed_out
        assert len(result.stdout) < 10_000_000 and result.stdout.startswith("xxxx")
        assert not result.stdout.endswith("x"), "a cut output ends with a marker saying how much was cut"

    def test_no_network(self) -> None:
        import socket

        self._skip_unless_isolated()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
            script = ("import socket\n"
                      f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
                      "    try:\n"
                      "        socket.create_connection(address, timeout=3).close()\n"
                      "        print('connected', address)\n"
                      "    except OSError:\n"
                      "        pass\n")
            result = self._run("python3 net.py", files={"net.py": script.encode()})
        assert result.exit_code == 0, result.stderr
        assert "connected" not in result.stdout

    def test_no_writes_outside_the_workspace(self) -> None:
        import os
        import shlex

        self._skip_unless_isolated()
        name = f"miles-sandbox-conformance-{os.getpid()}"
        targets = [f"/etc/{name}", f"/usr/{name}", os.path.join(os.path.expanduser("~"), name)]
        try:
            paths = " ".join(shlex.quote(target) for target in targets)
            result = self._run(f'for p in {paths}; do touch "$p" 2>/dev/null && echo "wrote $p"; done; true')
            assert result.stdout == ""
            assert not [target for target in targets if os.path.exists(target)]
        finally:
            for target in targets:
                if os.path.exists(target):
                    os.remove(target)

    def test_concurrent_runs(self) -> None:
        import asyncio

        async def body(sandbox: Any) -> list[Any]:
            return await asyncio.gather(*(sandbox.run(f"sleep 0.2; cat in{i}.txt; echo {i} >&2", timeout_s=60,
                                                      files={f"in{i}.txt": f"run {i}\n".encode()}) for i in range(16)))

        results = self._with_sandbox(body)
        assert [(r.stdout, r.stderr, r.exit_code) for r in results] == [(f"run {i}\n", f"{i}\n", 0) for i in range(16)]

    def test_nothing_is_left_running_after_close(self) -> None:
        import asyncio

        background, foreground = self.unique_sleep(), self.unique_sleep()

        async def body(sandbox: Any) -> Any:
            first = await sandbox.run(f"{background} >/dev/null 2>&1 & echo started", timeout_s=30)
            assert first.stdout == "started\n"
            running = asyncio.ensure_future(sandbox.run(foreground, timeout_s=120))
            for _ in range(100):  # a local sandbox's process shows up here; a remote one's never does
                if self.pids_running(foreground) or running.done():
                    break
                await asyncio.sleep(0.05)
            await sandbox.close()
            done, _ = await asyncio.wait({running}, timeout=60)  # it returns or raises, but does not hang
            return running in done

        assert self._with_sandbox(body), "a run still going when the sandbox closed did not end"
        assert self.wait_until_gone(background) == [] and self.wait_until_gone(foreground) == []


class ScriptedPolicy:
    """An engine stand-in for checking environments: it answers every turn with the text a scripted policy
    gives, as the tokens a real engine would return (the turn's end-of-turn token included, log-prob 0.0).

    ``act(turn, observation)`` gets the number of the turn (1, 2, ...) and the text of the last message the
    model saw (the prompt's last message on turn 1), decoded from the prompt tokens it is sent.
    """

    def __init__(self, tokenizer: Any, act: Any, eot: str = "<|im_end|>") -> None:
        self.tokenizer, self.act = tokenizer, act
        self.eot_id = tokenizer.convert_tokens_to_ids(eot)
        self.calls = 0

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], return_logprob: bool = True) -> dict:
        self.calls += 1
        text = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        turns = text.split("<|im_start|>")
        turn = sum(part.startswith("assistant") for part in turns)  # the generation prompt is the last one
        last = turns[-2] if len(turns) >= 2 else ""
        observation = last.split("\n", 1)[1] if "\n" in last else ""
        observation = observation.removesuffix("\n").removesuffix("<|im_end|>")
        ids = self.tokenizer.encode(self.act(turn, observation), add_special_tokens=False) + [self.eot_id]
        limit = int(sampling_params.get("max_new_tokens", len(ids)))
        finish = {"type": "stop", "matched": self.eot_id} if len(ids) <= limit else {"type": "length", "length": limit}
        ids = ids[:limit]
        return {"output_ids": ids, "text": self.tokenizer.decode(ids),
                "meta_info": {"output_token_logprobs": [[0.0, i, None] for i in ids], "finish_reason": finish,
                              "weight_version": 0, "prompt_tokens": len(input_ids), "completion_tokens": len(ids)}}


class _WatchedEnv:
    """An env as the conformance checks see it: counts closes and steps, and fails a step on request."""

    def __init__(self, env: Any, fail_at_step: int | None = None) -> None:
        self.env, self.fail_at_step = env, fail_at_step
        self.steps = self.closes = 0

    @property
    def tools(self) -> Any:
        return getattr(self.env, "tools", None)

    async def reset(self, sample: Any) -> Any:
        return await self.env.reset(sample)

    async def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.steps}")
        return await self.env.step(action)

    async def close(self) -> None:
        self.closes += 1
        await self.env.close()


class EnvConformance:
    """The contract every environment keeps. Subclass it in a test module of your env plugin:

        class TestMyEnv(EnvConformance):
            min_steps = 2

            def make_env(self, ctx):
                return MyEnv(ctx, url=...)

            def act(self, turn, observation):
                return '<tool_call>{"name": "guess", "arguments": {"n": 5}}</tool_call>'

    Episodes run through Miles' real ``multi_turn`` rollout function with a :class:`ScriptedPolicy` in place
    of the engine (the policy is the test's input here; the env is what is checked) and the tiny chat
    tokenizer of the ``chat_model_dir`` fixture (``from miles.testing import chat_model_dir`` in your
    ``conftest.py``; ``pytest_plugins`` works only in a repository's top conftest).
    """

    min_steps: int = 2  # the scripted policy's episodes take at least this many env steps
    max_turns: int = 8
    tool_parser: str = "hermes"
    episodes: int = 16  # episodes at once in the concurrency checks
    timeout_s: float = 300.0  # a safety net per check, not a measurement

    def make_env(self, ctx: Any) -> Any:
        """A fresh env, as your registered factory makes it for ``ctx`` (a :class:`miles.EnvContext`)."""
        raise NotImplementedError

    def act(self, turn: int, observation: str) -> str:
        """The scripted policy: the text of assistant turn ``turn`` given the last message's text."""
        raise NotImplementedError

    def make_sample(self, index: int) -> Sample:
        """The sample episode ``index`` starts from."""
        return Sample(prompt=f"episode {index}", prompt_ids=[0], index=index, metadata={"data": {}})

    def expected_reward(self, index: int) -> float | None:
        """The reward episode ``index`` must end with; None accepts any number (or dict of numbers)."""
        return None

    def sandbox_factory(self) -> Any:
        """The sandbox factory for envs that use ``ctx.sandbox`` (None: no sandbox)."""
        return None

    def leftovers(self) -> list[str]:
        """What the env's backing service still holds (sessions, containers ...); [] once every env closed."""
        return []

    # -- the harness ----------------------------------------------------------------------------------

    @fixture(autouse=True)
    def _env_harness(self, chat_model_dir: Path) -> None:
        self.set_up_harness(chat_model_dir)

    def set_up_harness(self, model_dir: Path) -> None:
        """The tokenizer and the registry the checks use (the fixture calls it; so can a test of the harness)."""
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._registry = make_registry(autoload=True)

    def _context(self, fail: dict[int, int] | None = None) -> tuple[Any, list[_WatchedEnv]]:
        from miles.config.validate import resolve_tool
        from miles.rollout.context import RolloutContext

        made: list[_WatchedEnv] = []

        def factory(env_ctx: Any) -> _WatchedEnv:
            watched = _WatchedEnv(self.make_env(env_ctx), (fail or {}).get(len(made)))
            made.append(watched)
            return watched

        ctx = RolloutContext(
            engine=ScriptedPolicy(self._tokenizer, self.act), tokenizer=self._tokenizer,
            sampling_params={"max_new_tokens": 4096}, env=factory, sandbox=self.sandbox_factory(),
            tool_parser=self._registry.build("tool_parser", {"name": self.tool_parser}, "rollout.tool_parser"),
            tool=lambda name: resolve_tool(self._registry, name, "rollout.env.tools"))
        return ctx, made

    def run_episodes(self, count: int, fail: dict[int, int] | None = None) -> tuple[list[Sample], list[_WatchedEnv]]:
        """Run ``count`` episodes at once (episode ``i``'s env fails at step ``fail[i]``); wait until no
        other task of the loop is left, and return the samples and the envs."""
        import asyncio

        from miles.rollout.generate import run_one
        from miles.rollout.multi_turn import MultiTurn

        ctx, made = self._context(fail)
        samples = [self.make_sample(i) for i in range(count)]
        rollout = MultiTurn(max_turns=self.max_turns)

        async def main() -> list[asyncio.Task]:
            await asyncio.wait_for(asyncio.gather(*(run_one(rollout, s, ctx) for s in samples)), self.timeout_s)
            for _ in range(200):  # background work of closed envs (a socket's closing handshake) winds down
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
                if not others:
                    break
                await asyncio.sleep(0.05)
            return others

        left = asyncio.run(main())
        assert not left, f"tasks still running after every episode ended: {left}"
        return samples, made

    def _check_finished(self, sample: Sample, index: int) -> None:
        from miles.types import SampleStatus

        assert sample.status is SampleStatus.COMPLETED, f"episode {index}: {sample.status.value}: {sample.reason}"
        assert sample.turns >= self.min_steps, f"episode {index} ended after {sample.turns} turns"
        reward = sample.metadata.get("env_reward")
        assert reward is not None, f"episode {index} ended without a reward from the env"
        values = reward.values() if isinstance(reward, dict) else [reward]
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values), reward
        expected = self.expected_reward(index)
        if expected is not None:
            assert reward == pytest.approx(expected), f"episode {index}: reward {reward}, expected {expected}"
        if sample.turns >= 2:
            assert sample.loss_mask.count(0) > 0, "the env's observations belong in the trajectory (loss mask 0)"

    @staticmethod
    def _children() -> set[int]:
        """Live child processes of this process (zombies reaped or not, they are not running)."""
        import os

        children = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == os.getpid() and fields[0] != "Z":
                    children.add(int(entry.name))
        return children

    def test_an_episode_runs_to_done_with_a_reward(self) -> None:
        (sample,), (env,) = self.run_episodes(1)
        self._check_finished(sample, 0)
        assert env.steps >= self.min_steps and env.closes == 1

    def test_reset_step_and_close_called_directly(self) -> None:
        import asyncio

        from miles.agentic.chat import normalize_messages
        from miles.agentic.tool_calls import check_calls
        from miles.agentic.types import Action, EnvContext, StepResult

        ctx, _ = self._context()

        async def main() -> tuple[Any, Any, StepResult]:
            env_ctx = EnvContext(ctx.sandbox, ctx.tool, 0)
            env = self.make_env(env_ctx)
            try:
                first = normalize_messages(await env.reset(self.make_sample(0)), role="user")
                tools = list(getattr(env, "tools", None) or [])
                text = self.act(1, str(first[-1].get("content", "")) if first else "episode 0")
                calls = check_calls(ctx.tool_parser.parse(text), tools)
                result = await env.step(Action(text, calls.valid))
                return first, tools, result
            finally:
                await env.close()
                await env_ctx.close()

        first, tools, result = asyncio.run(main())
        assert isinstance(first, list) and all(isinstance(m, dict) and "role" in m for m in first)
        assert all(t.get("type") == "function" and "name" in t["function"] for t in tools), tools
        assert isinstance(result, StepResult), f"step returned {type(result).__name__}, expected StepResult"
        assert isinstance(result.info, dict)

    def test_concurrent_episodes(self) -> None:
        samples, envs = self.run_episodes(self.episodes)
        for i, sample in enumerate(samples):
            self._check_finished(sample, i)
        assert [env.closes for env in envs] == [1] * self.episodes

    def test_an_env_that_raises_fails_only_its_sample(self) -> None:
        from miles.types import SampleStatus

        broken = self.episodes // 2
        samples, envs = self.run_episodes(self.episodes, fail={broken: 2 if self.min_steps >= 2 else 1})
        assert samples[broken].status is SampleStatus.FAILED
        assert "injected failure" in (samples[broken].reason or ""), samples[broken].reason
        for i, sample in enumerate(samples):
            if i != broken:
                self._check_finished(sample, i)
        assert [env.closes for env in envs] == [1] * self.episodes, "every env is closed, the failed one too"

    def test_nothing_is_left_running(self) -> None:
        before = self._children()
        self.run_episodes(4, fail={1: 1})
        assert self.leftovers() == [], "the env's service still holds something after every env closed"
        assert not (self._children() - before), "a process an env started outlived its episode"
