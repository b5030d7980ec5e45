"""``BackendConformance``: the contract every training backend keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.testing.fixtures import fixture, make_train_batch, pytest


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

    def _ready(self, model_dir: Path, **split: Any) -> Any:
        backend = self.make_backend(**split)
        self._made.append(backend)
        backend.setup(str(model_dir), seed=0)
        return backend

    def _step(self, model_dir: Path, batch: Any, loss_fn: Any, **split: Any) -> dict[str, float]:
        """One step on a fresh backend, shut down afterwards (only one holds workers at a time)."""
        backend = self._ready(model_dir, **split)
        metrics = backend.train_step(batch, loss_fn)
        backend.shutdown()
        return metrics

    @fixture(scope="class")
    @classmethod
    def first_step(cls, tiny_model_dir: Path, tmp_path_factory: Any) -> dict[str, Any]:
        """One fresh backend taken through its first step, observed on the way and shut down: its export and
        log-probs before training, the step's metrics, its export after and a ``save_pretrained`` directory.
        The checks below each read their part (starting a backend costs seconds: once per class)."""
        from transformers import AutoTokenizer

        from miles.train.losses import ppo_clip

        batch, out = make_train_batch(), tmp_path_factory.mktemp("first-step") / "out"
        backend = cls().make_backend()
        try:
            backend.setup(str(tiny_model_dir), seed=0, ref_model_path=str(tiny_model_dir))
            before = {k: v.detach().cpu().clone() for k, v in backend.export_weights().items()}
            logprobs, ref = backend.compute_logprobs(batch), backend.ref_logprobs(batch)
            metrics = backend.train_step(make_train_batch(), ppo_clip)
            after = {k: v.detach().cpu().clone() for k, v in backend.export_weights().items()}
            backend.save_pretrained(str(out), AutoTokenizer.from_pretrained(tiny_model_dir), {"step": 1})
        finally:
            backend.shutdown()
        return {"batch": batch, "before": before, "logprobs": logprobs, "ref": ref, "metrics": metrics,
                "after": after, "saved": out}

    def test_step_metrics_include_the_required_figures(self, first_step: dict[str, Any]) -> None:
        required = {"train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/clip_frac",
                    "train/rollout_logprob_abs_diff", "train/lr"}
        assert required <= set(first_step["metrics"]), sorted(required - set(first_step["metrics"]))

    def test_logprobs_match_a_transformers_forward(self, tiny_model_dir: Path, first_step: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        batch, logprobs, ref = first_step["batch"], first_step["logprobs"], first_step["ref"]
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids).logits[:, :-1].float()
        expected = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        mask = batch.loss_mask.bool()
        assert logprobs.shape == ref.shape == batch.loss_mask.shape
        assert torch.allclose(logprobs[mask], expected[mask], atol=1e-4)
        assert torch.allclose(ref[mask], expected[mask], atol=1e-4)

    def test_resuming_from_a_checkpoint_repeats_the_next_step(self, tiny_model_dir: Path, tmp_path: Path) -> None:
        from miles.train.losses import ppo_clip

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

    def test_train_step_reports_metrics_and_changes_weights(self, first_step: dict[str, Any]) -> None:
        import math

        import torch

        metrics, before, after = first_step["metrics"], first_step["before"], first_step["after"]
        assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])
        assert before.keys() == after.keys()
        assert any(not torch.equal(before[k], after[k]) for k in before)

    def test_exported_weights_match_the_hf_model(self, tiny_model_dir: Path, first_step: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        exported = first_step["before"]
        assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in reference.items()}
        for name, tensor in exported.items():  # before any step: the weights the backend loaded
            assert torch.equal(tensor, reference[name]), name

    def test_save_pretrained_loads_with_transformers(self, first_step: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(first_step["saved"]).state_dict()
        for name, tensor in first_step["after"].items():
            assert torch.equal(loaded[name], tensor), name
        assert (first_step["saved"] / "miles.json").is_file()

    def test_same_seed_same_step(self, tiny_model_dir: Path) -> None:
        from miles.train.losses import ppo_clip

        first, second = (self._step(tiny_model_dir, make_train_batch(), ppo_clip) for _ in range(2))
        assert first["train/loss"] == second["train/loss"] and first["train/grad_norm"] == second["train/grad_norm"]

    def test_how_the_batch_is_split_does_not_change_the_step(self, tiny_model_dir: Path) -> None:
        import pytest as _pytest

        from miles.train.losses import ppo_clip

        if not self.split_options:
            _pytest.skip("this backend declares no split options")
        results = [self._step(tiny_model_dir, make_train_batch(), ppo_clip, **split) for split in self.split_options]
        for other in results[1:]:
            assert other["train/loss"] == _pytest.approx(results[0]["train/loss"], abs=1e-5)
            assert other["train/grad_norm"] == _pytest.approx(results[0]["train/grad_norm"], rel=1e-5)

