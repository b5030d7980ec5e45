"""configs/your_model.yaml as docs/your_model.md uses it: your checkpoint (a local folder, or a Hub id taken from
the Hub's cache), your data (a Parquet file with columns of its own names) and the math reward.

Offline: the "Hub" model is a real Hugging Face cache entry (``models--ORG--NAME/snapshots/REV`` and ``refs/main``)
that the test lays out from a checkpoint Miles' SFT recipe made; ``huggingface_hub`` resolves it as it would a
downloaded one. Hub datasets cannot be reached from here: only their refusal offline is tested."""

import json
import shutil

import pytest

from tests.conftest import run_miles

CONFIG = "configs/your_model.yaml"
REVISION = "0123456789abcdef0123456789abcdef01234567"
SMALL = ["rollout.engine={name: local}", "backend={name: torch, lr: 1.0e-4, micro_batch_size: 64}",
         "rollout.prompts_per_step=8", "rollout.n_samples=4", "rollout.sampling.max_new_tokens=4",
         "run.steps=3", "run.eval_size=0", "run.progress=false", "run.torch_threads=1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The quickstart's SFT model (it adds single digits) and the addition pairs it was trained on."""
    run_dir = tmp_path_factory.mktemp("sft")
    out = run_miles("train", "configs/quickstart.yaml", f"run.dir={run_dir}", "run.steps=0", "run.progress=false")
    assert out.returncode == 0, out.stderr
    return run_dir / "sft_model", [json.loads(line) for line in (run_dir / "data" / "train.jsonl").open()]


@pytest.fixture(scope="module")
def parquet(checkpoint, tmp_path_factory):
    """The pairs as a dataset of its own: columns `question` and `answer` (a worked answer ending `#### 7`)."""
    import datasets

    rows = [{"question": r["prompt"], "answer": f"{r['prompt']}{r['label']}, so #### {r['label']}"}
            for r in checkpoint[1]]
    path = tmp_path_factory.mktemp("data") / "sums.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def hub_cache(root, repo: str, folder) -> dict[str, str]:
    """``folder`` as the Hub's cache holds a downloaded model repository; the environment that points at it."""
    entry = root / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, entry / "snapshots" / REVISION)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(REVISION)
    return {"HF_HOME": str(root), "HF_HUB_OFFLINE": "1"}


def scored(run_dir) -> list[tuple[float, bool]]:
    """Each shown sample's reward, and whether its response is the number after the label's "####"."""
    samples = [json.loads(line) for step in sorted((run_dir / "trajectories").iterdir()) for line in step.open()]
    assert samples and all(s["prompt"].endswith("=") for s in samples)  # the `question` column
    return [(s["reward"], s["response_text"].strip() == s["label"].rsplit("#### ", 1)[1]) for s in samples]


def test_a_local_checkpoint_and_a_parquet_file_with_columns_of_its_own(checkpoint, parquet, tmp_path):
    run_dir = tmp_path / "run"
    out = run_miles("train", CONFIG, f"model.path={checkpoint[0]}", f"data.train_path={parquet}",
                    "data.eval_path=null", f"run.dir={run_dir}", *SMALL)
    assert out.returncode == 0, out.stderr
    # the math reward compares the response with the label's number after "####" (the checkpoint adds: some right)
    pairs = scored(run_dir)
    assert all(reward == float(right) for reward, right in pairs), pairs
    assert any(right for _, right in pairs) and not all(right for _, right in pairs)


def test_a_hub_id_is_taken_from_the_hubs_cache(checkpoint, parquet, tmp_path):
    """`miles config` makes every check `miles train` makes: the model is found, its tokenizer encodes the data."""
    env = hub_cache(tmp_path / "hf", "acme/adder", checkpoint[0])
    overrides = ["model.path=acme/adder", f"data.train_path={parquet}", "data.eval_path=null",
                 f"run.dir={tmp_path / 'run'}", *SMALL]
    out = run_miles("config", "--check", CONFIG, *overrides, env=env)
    assert out.returncode == 0, out.stderr
    assert "path: acme/adder" in out.stdout
    # the same id without the cache entry is refused (the refusals below): it was the cache that answered
    assert run_miles("config", "--check", CONFIG, *overrides, env={"HF_HOME": str(tmp_path / "empty")}).returncode == 2


@pytest.mark.parametrize("override, message", [
    ("model.path=acme/not-cached", "model.path 'acme/not-cached': not a local directory, and the Hugging Face Hub "
                                   "model of that id could not be had (HF_HUB_OFFLINE is set"),
    ("model.path=no/such/folder", "model.path 'no/such/folder': no such directory, nor a Hugging Face Hub model id"),
    ("data.train_path=hf:acme/not-cached", "data.train_path 'hf:acme/not-cached': split 'train' of subset 'main' "
                                           "could not be loaded (HF_HUB_OFFLINE is set"),
])
def test_what_cannot_be_had_offline_is_refused_naming_it(checkpoint, parquet, tmp_path, override, message):
    env = {"HF_HOME": str(tmp_path / "hf")}
    overrides = [f"model.path={checkpoint[0]}", f"data.train_path={parquet}", "data.eval_path=null", override,
                 f"run.dir={tmp_path / 'run'}", *SMALL]
    out = run_miles("config", "--check", CONFIG, *overrides, env=env)
    assert out.returncode == 2, out.stdout
    assert message in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()
