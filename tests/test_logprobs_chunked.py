"""Memory-bounded log-probs: the chunked path equals the whole one (values and gradients), never makes a
[tokens x vocab] float32 tensor, goes through the backends, and its kernels are chosen by name per process."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from torch.utils._python_dispatch import TorchDispatchMode

import miles
from miles.train.losses import ppo_clip
from miles.errors import ConfigError
from miles.testing import make_registry, make_train_batch
from miles.train import kernels
from miles.train.kernels import TorchKernel, check_kernel_name, select_kernel
from miles.train.logprobs import token_logprobs
from miles.train.regularizers import regularized
from miles.train.torch_backend import TorchBackend

VOCAB = 37


def tiny_model(tied: bool = True, bias: bool = False, vocab: int = VOCAB) -> torch.nn.Module:
    config = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if bias:
        model.lm_head = torch.nn.Linear(32, vocab, bias=True)
    return model


def padded_ids(rows: int = 3, length: int = 9, vocab: int = VOCAB) -> torch.Tensor:
    ids = torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    ids[1, 5:] = 0  # right padding
    ids[2, 7:] = 0
    return ids


def run(model, ids, **chunked):
    """log-probs, entropy and every parameter's gradient of a loss that uses both."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs(model, ids, with_entropy=True, entropy_grad=True, **chunked)
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(2))
    ((logprobs * weights).sum() + 0.3 * (entropy * weights.flip(0)).sum()).backward()
    return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close(whole, chunked, atol=1e-5):
    torch.testing.assert_close(chunked[0], whole[0], atol=atol, rtol=0)
    torch.testing.assert_close(chunked[1], whole[1], atol=atol, rtol=0)
    assert whole[2].keys() == chunked[2].keys()
    for name in whole[2]:
        torch.testing.assert_close(chunked[2][name], whole[2][name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("tied,bias", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("chunk_tokens,vocab_block", [(1, 65536), (5, 65536), (7, 8), (100, 8), (24, 36)])
def test_chunked_path_equals_the_whole_one(tied, bias, chunk_tokens, vocab_block):
    """3 rows x 8 positions = 24 tokens (padding included): chunks of 1, 5 and 7 (not dividing 24), one chunk
    larger than the batch, one exactly; vocabulary blocks of 8 and 36 (37 columns: not dividing either)."""
    model, ids = tiny_model(tied, bias), padded_ids()
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    whole = run(model, ids)
    chunked = run(model, ids, chunk_tokens=chunk_tokens, kernel=TorchKernel(vocab_block=vocab_block))
    assert_close(whole, chunked)
    assert "forward" not in vars(model.lm_head)  # the output layer is itself again
    if bias:
        assert chunked[2]["lm_head.bias"].abs().sum() > 0


def test_under_autocast_both_paths_see_the_same_logits():
    """bfloat16 autocast (as on a GPU): the chunk's logits matmul runs in bfloat16 like the model's own output
    layer, so log-probs and entropy agree to float32 rounding; gradients to bfloat16 rounding (the chunked
    path sums the weight's gradient over chunks in float32)."""
    model, ids = tiny_model(), padded_ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole, chunked = run(model, ids), run(model, ids, chunk_tokens=5)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-5, rtol=0)
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, atol=0.01 * float(grad.abs().max()), rtol=0, msg=name)


def test_outputs_and_gradient_flags_match_the_whole_path():
    model, ids = tiny_model(), padded_ids()
    for chunk in (0, 4):
        logprobs = token_logprobs(model, ids, chunk_tokens=chunk)
        assert isinstance(logprobs, torch.Tensor) and logprobs.shape == (3, 8) and logprobs.requires_grad
        logprobs, entropy = token_logprobs(model, ids, with_entropy=True, chunk_tokens=chunk)
        assert logprobs.requires_grad and not entropy.requires_grad  # no entropy_grad: no gradient
        with torch.no_grad():
            logprobs, entropy = token_logprobs(model, ids, with_entropy=True, entropy_grad=True, chunk_tokens=chunk)
        assert not logprobs.requires_grad and not entropy.requires_grad
    # Only the entropy in the loss (with entropy_grad): its gradient alone, as the whole path gives.
    grads = []
    for chunk in (0, 4):
        model.zero_grad(set_to_none=True)
        _, entropy = token_logprobs(model, ids, with_entropy=True, entropy_grad=True, chunk_tokens=chunk)
        entropy.sum().backward()
        grads.append(model.lm_head.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=0)


def test_the_output_layer_is_restored_when_the_forward_fails():
    model, ids = tiny_model(), padded_ids()
    with pytest.raises(IndexError):
        token_logprobs(model, ids + VOCAB, chunk_tokens=4)  # ids outside the vocabulary
    assert "forward" not in vars(model.lm_head)
    assert model(input_ids=ids).logits.shape == (3, 9, VOCAB)


def test_models_that_transform_their_logits_are_refused():
    model = tiny_model()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        token_logprobs(model, padded_ids(), chunk_tokens=4)


class LargestFloat32(TorchDispatchMode):
    """The most elements of any float32 tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_no_tokens_x_vocab_float32_tensor_forward_or_backward(chunk_tokens):
    """A wide vocabulary (4096) against a small model: the whole path makes [tokens x vocab] float32 tensors
    (128 x 4096), the chunked one nothing larger than the output layer's weight and its gradient (4096 x 32;
    its chunks are 16 x 4096)."""
    vocab = 4096
    model, ids = tiny_model(tied=False, vocab=vocab), padded_ids(rows=4, length=33, vocab=vocab)
    tokens = 4 * 32
    with LargestFloat32() as mode:
        logprobs, entropy = token_logprobs(model, ids, with_entropy=True, entropy_grad=True, chunk_tokens=chunk_tokens,
                                           kernel=TorchKernel(vocab_block=1024))
        (logprobs.sum() + entropy.sum()).backward()
    if chunk_tokens:
        assert mode.largest == vocab * 32
    else:
        assert mode.largest >= tokens * vocab


# -- through the backends -------------------------------------------------------------------------------


def test_torch_backend_steps_equal_with_and_without_chunks(tiny_model_dir):
    """Two steps with a reference model (KL) and an entropy bonus (the entropy's gradient): every metric and
    the log-probs agree within 1e-5."""
    loss = regularized(ppo_clip, kl_coef=0.1, entropy_coef=0.01)

    def steps(**options):
        backend = TorchBackend(lr=1e-2, micro_batch_size=4, **options)
        backend.setup(str(tiny_model_dir), seed=0, ref_model_path=str(tiny_model_dir))
        out = [backend.compute_logprobs(make_train_batch(seed=5, rows=9))]
        out += [backend.train_step(make_train_batch(seed=k, rows=9), loss) for k in range(2)]
        backend.shutdown()
        return out

    whole, chunked = steps(), steps(logprob_chunk_tokens=5)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=0)
    for one, two in zip(whole[1:], chunked[1:]):
        assert one.keys() == two.keys()
        for key in one:
            assert two[key] == pytest.approx(one[key], abs=1e-5), key
    assert whole[2]["train/kl"] > 0  # the second step's policy differs from the reference


# -- kernels: registration, selection, fallback ------------------------------------------------------


class FakeKernel(TorchKernel):
    """The torch kernel under another name, runnable where ``runs_on`` says."""

    runs_on = "cpu"

    def unavailable(self, device):
        return None if torch.device(device).type == self.runs_on else f"fake runs on {self.runs_on} only"


class GpuOnlyKernel(FakeKernel):
    runs_on = "cuda"


class KernelPlugin:
    @miles.hookimpl
    def miles_register_logprob_kernels(self, register):
        register("fake", FakeKernel)
        register("gpu_only", GpuOnlyKernel)


@pytest.fixture
def registry(monkeypatch):
    """A process registry of the builtins and KernelPlugin (what a worker with that plugin installed sees)."""
    registry = make_registry(KernelPlugin())
    monkeypatch.setattr(kernels, "kernel_registry", lambda: registry)
    monkeypatch.setattr(kernels, "_warned", set())
    return registry


def test_the_builtin_torch_kernel_is_registered_by_a_builtin_plugin():
    registry = make_registry()
    entry = registry.get("logprob_kernel", "torch")
    assert entry.builtin and entry.plugin.module == "miles.builtin.kernels" and entry.obj is TorchKernel
    assert "torch" in kernels.kernel_registry().names("logprob_kernel")  # this process's own registry


def test_selection_by_name(registry, caplog):
    assert type(select_kernel("torch", "cpu")) is TorchKernel
    assert type(select_kernel("fake", "cpu")) is FakeKernel
    assert type(select_kernel("auto", "cpu")) is FakeKernel  # the first other kernel (by name) that can run
    assert type(select_kernel("miles.train.kernels:TorchKernel", "cpu")) is TorchKernel  # an import path
    with caplog.at_level(logging.WARNING, logger="miles.train.kernels"):
        for _ in range(3):
            assert type(select_kernel("gpu_only", "cpu")) is TorchKernel
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["backend.logprob_kernel: kernel 'gpu_only' cannot run on cpu (fake runs on cuda only); "
                        "using the torch kernel"]


def test_auto_falls_back_to_torch_when_no_other_kernel_runs():
    class OnlyGpu:
        @miles.hookimpl
        def miles_register_logprob_kernels(self, register):
            register("gpu_only", GpuOnlyKernel)

    assert type(select_kernel("auto", "cpu", make_registry(OnlyGpu()))) is TorchKernel
    assert type(select_kernel("auto", "cpu", make_registry())) is TorchKernel


def test_unknown_kernel_names_are_config_errors(registry):
    with pytest.raises(ConfigError, match=r"backend\.logprob_kernel: unknown log-prob kernel 'fak'; known: auto, "
                                          r"fake, gpu_only, torch; did you mean 'fake'\?"):
        check_kernel_name("fak")
    with pytest.raises(ConfigError, match="backend.logprob_kernel: unknown log-prob kernel 'nope'"):
        select_kernel("nope", "cpu")
    with pytest.raises(ConfigError, match="backend.logprob_kernel: cannot import"):
        check_kernel_name("no_such_module:Kernel")
    check_kernel_name("gpu_only")  # known here, even if this device cannot run it
    with pytest.raises(ConfigError, match=r"backend\.logprob_kernel: unknown log-prob kernel 'fak'.*'fake'"):
        TorchBackend(logprob_kernel="fak")
    TorchBackend(logprob_kernel="fake", logprob_chunk_tokens=8)


def test_a_bad_kernel_name_exits_2_from_the_command_line(miles_cli, tmp_path):
    done = miles_cli("config", "configs/quickstart.yaml", f"run.dir={tmp_path}", "backend.logprob_kernel=no_such",
                     env={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert done.returncode == 2, done.stderr
    assert "backend.logprob_kernel: unknown log-prob kernel 'no_such'; known: auto, torch" in done.stderr
    assert "Traceback" not in done.stderr


def test_policy_selects_its_kernel_in_its_own_process(registry, tiny_model_dir, monkeypatch):
    backend = TorchBackend(logprob_kernel="fake", logprob_chunk_tokens=4)
    backend.setup(str(tiny_model_dir), seed=0)
    assert type(backend.policy.logprob_kernel) is FakeKernel
    calls = []
    original = FakeKernel.forward
    monkeypatch.setattr(FakeKernel, "forward",
                        lambda self, logits, targets: calls.append(logits.shape) or original(self, logits, targets))
    backend.compute_logprobs(make_train_batch(rows=3))
    assert calls and all(rows <= 4 for rows, _ in calls)  # the chunked path ran, with that kernel
    unchunked = TorchBackend(logprob_kernel="fake")
    unchunked.setup(str(tiny_model_dir), seed=0)
    assert unchunked.policy.logprob_kernel is None  # logprob_chunk_tokens 0: no kernel needed


def test_the_megatron_backend_refuses_the_chunked_path():
    pytest.importorskip("miles_megatron")
    from miles_megatron.backend import MegatronBackend

    with pytest.raises(ConfigError, match="backend.logprob_chunk_tokens=8"):
        MegatronBackend(logprob_chunk_tokens=8)
    with pytest.raises(ConfigError, match="backend.logprob_kernel='auto'"):
        MegatronBackend(logprob_kernel="auto")
