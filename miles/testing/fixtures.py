"""Helpers and pytest fixtures: the tiny models and tokenizers, registries, samples and batches, engines served
for a test, and the ``chat_model_dir``, ``tiny_model_dir``, ``vlm_model_dir``, ``miles_registry`` and ``ray_cluster``
fixtures."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from miles.config.schema import ModelBuildConfig, TokenizerConfig
from miles.models.hf import build_model_dir
from miles.plugins import build_plugin_manager
from miles.ports import free_port
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


# The `miles` command line, to run with subprocess, with Ctrl-C restored: a shell without job control starts
# background commands with SIGINT ignored and a child inherits that, so a test that sends SIGINT uses this.
MILES_WITH_CTRL_C = [sys.executable, "-c", "import runpy, signal; "
                     "signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "runpy.run_module('miles', run_name='__main__')"]


def local_engine(model_dir: str | Path, **kwargs: Any) -> Any:
    """A ``local`` rollout engine (``LocalEngine(**kwargs)``, seed 3 unless given) with ``model_dir`` loaded."""
    from miles.engine.local import LocalEngine

    engine = LocalEngine(**{"seed": 3, **kwargs})
    engine.load_model(str(model_dir))
    return engine


def generate_all(engine: Any, prompts: list[list[int]], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The answers of ``engine`` to ``prompts``, all asked in one event-loop turn (admitted together)."""
    import asyncio

    async def go() -> list[dict[str, Any]]:
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    return asyncio.run(go())


@contextlib.contextmanager
def serve_engine(model_dir: str | Path, *args: str, timeout_s: float = 120.0) -> Iterator[str]:
    """``miles engine serve`` for ``model_dir`` in a process of its own on a free 127.0.0.1 port (one torch
    thread), started by the ``miles_server`` launcher; yields its base URL once ``/health`` answers, and stops
    the process (and removes its log) on exit. ``args``: more ``miles engine serve`` flags."""
    from miles.engine.launchers import MilesServerLauncher

    port = free_port()
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

    from miles.engine.server import app_runner, build_app

    loop = asyncio.new_event_loop()
    runner = app_runner(build_app(engine))
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


VISION_TOKENIZER = {"special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                                       "<|vision_end|>"], "chat_template": "qwen2_vl"}


def build_vlm(path: str | Path, alphabet: str = CHAT_ALPHABET, seed: int = 0, **build: Any) -> Path:
    """A tiny random-init Qwen2.5-VL model (a 2-block vision tower; 14-pixel patches, 2x2 merged: a 56x56 image
    is 4 tokens, at most 112x112: 16) with a char tokenizer holding the vision tokens and the shipped ``qwen2_vl``
    chat template, and its image processor."""
    build.setdefault("max_position_embeddings", 256)
    return build_tiny_model(path, alphabet, seed, tokenizer=VISION_TOKENIZER, arch="qwen2_5_vl", **build)


@fixture(scope="session")
def vlm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny vision-language model (:func:`build_vlm`), built once per test session."""
    return build_vlm(tmp_path_factory.mktemp("miles-vlm") / "model")


@fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a chat template (:func:`build_chat_model`), built once per test session."""
    return build_chat_model(tmp_path_factory.mktemp("miles-chat-model") / "model")


@fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF-format model directory, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("miles-tiny-model") / "model")


@fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real local Ray instance with two CPUs (as on a 2-core CI machine) for one test module, shut down after it:
    a run joins the Ray instance its process already has, so none may outlive the tests that chose its size."""
    from miles.cluster import RayCluster
    from miles.config.schema import ClusterConfig

    cluster = RayCluster(OmegaConf.structured(ClusterConfig(num_cpus=2)), tmp_path_factory.mktemp("ray"))
    yield cluster
    cluster.shutdown()


@fixture
def miles_registry() -> Registry:
    """A registry of the builtins only (no installed plugins)."""
    return make_registry()


def make_train_batch(seed: int = 0, rows: int = 6, group_size: int = 3,
                     temperature: float | None = None) -> "TrainBatch":
    """A small GRPO batch of varied lengths over the addition alphabet, advantages filled in; ``temperature``: the
    samples were drawn at it (its log-probs are taken at it, ``rollout.logprobs_of: sampling``)."""
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
        if temperature is not None:
            samples[-1].record_sampling(0, {"temperature": temperature})
    batch = TrainBatch.from_samples(samples, pad_token_id=0, logprobs_of="sampling" if temperature else "model")
    batch.advantages = grpo(batch)
    return batch

