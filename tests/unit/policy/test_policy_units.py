"""Unit tests without Ray: mask, loss normalization, LR schedule, config, RNG restore."""

from __future__ import annotations

import math

import pytest
import torch

from sft_runtime.runtime.checkpoint import policy_files as ckpt
from sft_runtime.runtime.data.batch import SFTBatch
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.cluster_config import ClusterConfig
from sft_runtime.runtime.policy.config import (
    ModelConfig,
    PolicyConfig,
    check_batch_layout,
    parse_section,
)
from sft_runtime.runtime.policy.loss import NLLLossFn
from sft_runtime.runtime.policy.model import TinyTransformer, attention_mask
from tests.support import sources

SEQ_LEN, VOCAB = sources.SEQ_LEN, sources.VOCAB


def _tiny_model() -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(
        ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ_LEN)
    )
    return model.eval()


def _row(ids: list[int], segs: list[int], pos: list[int], length: int) -> tuple:
    pad = length - len(ids)
    return (
        torch.tensor(ids + [0] * pad),
        torch.tensor(segs + [-1] * pad),
        torch.tensor(pos + [0] * pad),
    )


def test_attention_mask_is_causal_block_diagonal_and_never_empty():
    seg = torch.tensor([[0, 0, 1, 1, -1]])
    m = attention_mask(seg)[0, 0]
    assert m.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, False],
        [False, False, True, True, False],
        [False, False, False, False, True],
    ]
    assert m.any(dim=-1).all()


def test_packed_row_logits_equal_separate_rows():
    model = _tiny_model()
    a, b = list(range(1, 8)), list(range(20, 31))
    packed = _row(a + b, [0] * 7 + [1] * 11, list(range(7)) + list(range(11)), 24)
    alone_a = _row(a, [0] * 7, list(range(7)), 24)
    alone_b = _row(b, [0] * 11, list(range(11)), 24)
    ids, seg, pos = (torch.stack(t) for t in zip(packed, alone_a, alone_b, strict=True))
    with torch.no_grad():
        logits = model(ids, pos, seg)
    assert torch.isfinite(logits).all()  # padding rows included: no NaNs
    torch.testing.assert_close(logits[0, :7], logits[1, :7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0, 7:18], logits[2, :11], rtol=1e-5, atol=1e-5)


def test_loss_is_normalized_by_the_global_token_count():
    batch = sources.global_batch(3, 2, 0, rows=4, seq_len=SEQ_LEN, vocab_size=VOCAB)
    logits = torch.randn(batch.num_rows, SEQ_LEN, VOCAB)
    fn = NLLLossFn()
    total = fn.valid_tokens(batch)
    # reference: plain mean over supervised targets, logits at t-1 predicting token t
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch.input_ids[:, 1:].reshape(-1), reduction="none"
    )
    mask = batch.loss_mask[:, 1:].reshape(-1)
    expected = (nll * mask).sum() / mask.sum()
    # split into 2 "ranks" x 2 micro-batches; contributions sum to the global mean
    parts = [batch.rows(i, i + 2) for i in range(0, 8, 2)]
    got = sum(fn(logits[i * 2 : i * 2 + 2], p, total)[0] for i, p in enumerate(parts))
    assert total == int(mask.sum())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_the_loss_gradient_is_the_sliced_logits_gradient_bit_for_bit():
    """The loss scores every position against the next token (the last against nothing)
    rather than slicing the logits; the gradient it gives is that of the sliced form exactly,
    for a micro-batch of several rows (where slicing copies)."""
    batch = sources.global_batch(3, 2, 0, rows=4, seq_len=SEQ_LEN, vocab_size=VOCAB)
    logits = torch.randn(batch.num_rows, SEQ_LEN, VOCAB, requires_grad=True)
    loss, metrics = NLLLossFn()(logits, batch, 37)
    (ours,) = torch.autograd.grad(loss, logits)
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch.input_ids[:, 1:].reshape(-1), reduction="none"
    ).view(batch.num_rows, SEQ_LEN - 1)
    sliced = (nll * batch.loss_mask[:, 1:]).sum() / 37
    (reference,) = torch.autograd.grad(sliced, logits)
    assert torch.equal(ours, reference)
    assert not ours[:, -1].any()  # the last position predicts nothing
    torch.testing.assert_close(loss, sliced, rtol=1e-6, atol=0)
    assert metrics["valid_tokens"] == batch.loss_mask[:, 1:].sum()


def test_loss_ignores_unsupervised_tokens_and_survives_zero_tokens():
    batch = sources.make_batch(1, 0, 0, rows=2, seq_len=SEQ_LEN, vocab_size=VOCAB)
    empty = SFTBatch(
        batch.input_ids,
        torch.zeros_like(batch.loss_mask),
        batch.position_ids,
        batch.segment_ids,
        batch.cu_seqlens,
        batch.source_ids,
        batch.sequence_lengths,
    )
    logits = torch.randn(2, SEQ_LEN, VOCAB)
    loss, metrics = NLLLossFn()(logits, empty, 0)
    assert loss.item() == 0.0 and metrics["valid_tokens"] == 0.0


@pytest.mark.parametrize(
    ("section", "data", "key"),
    [
        (PolicyConfig, {"train_micro_batch_size": 3}, "policy.train_global_batch_size"),
        (PolicyConfig, {"optimizer": {"kwargs": {"lr": -1}}}, "policy.optimizer.kwargs.lr"),
        (PolicyConfig, {"optimizer": {"lr": 1e-3}}, "policy.optimizer.kwargs.lr"),
        (PolicyConfig, {"model": {"d_model": 30, "n_heads": 4}}, "policy.model.d_model"),
        (PolicyConfig, {"scheduler": {"kind": "cosine"}}, "policy.scheduler.kind"),
        (PolicyConfig, {"precision": "float16"}, "policy.precision"),
        (PolicyConfig, {"bogus": 1}, "policy.bogus"),
        (ClusterConfig, {"cpus_per_worker": 0}, "cluster.cpus_per_worker"),
        (ClusterConfig, {"gpus_per_node": 1, "workers_per_node": 2}, "cluster.gpus_per_node"),
        (ClusterConfig, {"placement_strategy": "STRICT_SPREAD"}, "cluster.placement_strategy"),
    ],
)
def test_config_errors_name_the_dotted_key(section, data, key):
    prefix = "policy" if section is PolicyConfig else "cluster"
    with pytest.raises(UserInputError, match=key.replace(".", r"\.")):
        parse_section(section, data, prefix)


def test_config_defaults_and_batch_layout():
    cluster = parse_section(ClusterConfig, {"cpus_per_worker": 0.25}, "cluster")
    assert cluster.world_size == 2 and cluster.gpus_per_worker == 0
    policy = parse_section(
        PolicyConfig, {"train_global_batch_size": 8, "train_micro_batch_size": 2}, "policy"
    )
    assert check_batch_layout(policy, 2) == 4
    with pytest.raises(UserInputError, match=r"policy\.train_global_batch_size"):
        check_batch_layout(policy, 3)


def test_rng_restore_refuses_another_thread_count(tmp_path):
    state = ckpt.capture_rng(num_threads=1)
    path = ckpt.save_torch(str(tmp_path / "rng" / "rank_0.pt"), state)
    loaded = ckpt.load_torch(path, "RNG state")  # weights_only=True
    first = torch.rand(3)
    ckpt.restore_rng(loaded, 1, path)
    assert torch.equal(torch.rand(3), first)
    with pytest.raises(UserInputError, match="num_threads_per_worker=2"):
        ckpt.restore_rng(loaded, 2, path)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_replica_step_in_one_process(precision):
    from sft_runtime.runtime.policy.replica import Replica

    policy = PolicyConfig(
        dtensor_cfg={"enabled": False},
        model=ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=SEQ_LEN),
        train_global_batch_size=4,
        train_micro_batch_size=2,
        precision=precision,
    )
    replica = Replica(policy, seed=0, device=torch.device("cpu"))
    batch = sources.make_batch(0, 0, 0, rows=4, seq_len=SEQ_LEN, vocab_size=VOCAB)
    before = replica.files.weights()
    with pytest.raises(RuntimeError, match="before a successful begin_train_step"):
        replica.finish()
    replica.begin(None, lambda: batch)
    replica.train(batch)
    replica.abort()
    assert all(torch.equal(before[k], v) for k, v in replica.files.weights().items())
    replica.begin(None, lambda: batch)
    replica.train(batch)
    out = replica.finish()
    assert math.isfinite(out.loss) and out.valid_tokens == batch.loss_mask[:, 1:].sum()
    assert out.step == 1 and len(out.micro_batches) == 2
    assert not torch.equal(before["head.weight"], replica.files.weights()["head.weight"])


class _FloatMetricsLoss(NLLLossFn):
    """A user's loss that reports its metrics as Python floats (the older contract)."""

    def __call__(self, logits, batch, global_valid_tokens):
        loss, metrics = super().__call__(logits, batch, global_valid_tokens)
        return loss, {k: float(v) for k, v in metrics.items()}


def test_tensor_and_float_metrics_give_the_same_step_as_floats():
    """NLLLossFn's metrics stay tensors until the last micro-batch (one host sync per step);
    a loss returning floats trains the same step bit for bit and every metric comes out a
    float either way."""
    from sft_runtime.runtime.policy.replica import Replica

    policy = PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model=ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=SEQ_LEN),
        train_global_batch_size=6,
        train_micro_batch_size=2,
    )
    batch = sources.make_batch(0, 0, 0, rows=6, seq_len=SEQ_LEN, vocab_size=VOCAB)
    outs, weights = [], []
    for loss_fn in (NLLLossFn(), _FloatMetricsLoss()):
        replica = Replica(policy, seed=0, device=torch.device("cpu"))
        replica.begin(loss_fn, lambda: batch)
        trained = replica.train(batch)
        assert all(type(v) is float for mb in trained["micro_batches"] for v in mb.values())
        outs.append(replica.finish())
        weights.append(replica.files.weights())
    tensor_out, float_out = outs
    assert len(tensor_out.micro_batches) == 3
    assert tensor_out.loss == float_out.loss  # same float64 sum of the same nll sums
    expected = sum(mb["nll_sum"] for mb in float_out.micro_batches) / outs[0].valid_tokens
    assert tensor_out.loss == pytest.approx(expected, rel=1e-6)
    for key in ("nll_sum", "valid_tokens", "loss"):
        assert [mb[key] for mb in tensor_out.micro_batches] == [
            mb[key] for mb in float_out.micro_batches
        ]
    assert all(torch.equal(weights[0][k], v) for k, v in weights[1].items())


def test_abort_rewinds_the_rng_that_dropout_used():
    """A step undone by `abort` (a start sent ahead, then a stop) leaves the random streams as
    they were, so the step trained again later draws the same dropout masks: bitwise exact."""
    from sft_runtime.runtime.policy.replica import Replica

    policy = PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model=ModelConfig(
            vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=SEQ_LEN, dropout=0.2
        ),
        train_global_batch_size=4,
        train_micro_batch_size=2,
    )
    batch = sources.make_batch(0, 0, 0, rows=4, seq_len=SEQ_LEN, vocab_size=VOCAB)

    def one_step(replica: Replica, abort_first: bool) -> dict:
        torch.manual_seed(11)
        if abort_first:
            replica.begin(None, lambda: batch)
            replica.train(batch)
            assert not torch.equal(torch.get_rng_state(), _seeded_rng_state(11))
            replica.abort()
            assert torch.equal(torch.get_rng_state(), _seeded_rng_state(11))
        replica.begin(None, lambda: batch)
        replica.train(batch)
        replica.finish()
        return replica.files.weights()

    straight = one_step(Replica(policy, seed=0, device=torch.device("cpu")), False)
    undone_first = one_step(Replica(policy, seed=0, device=torch.device("cpu")), True)
    assert all(torch.equal(straight[k], v) for k, v in undone_first.items())


def _seeded_rng_state(seed: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.get_rng_state()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error torch gives without CUDA")
def test_a_gpu_worker_without_cuda_is_refused_naming_the_key(cluster_cfg, policy_cfg):
    """Ray may grant a GPU that torch cannot use (a CPU-only torch build, a hidden device):
    the worker refuses at start instead of silently training on the CPU."""
    from sft_runtime.runtime.workers.worker import PolicyWorkerBase

    cluster = cluster_cfg.model_copy(update={"gpus_per_node": cluster_cfg.workers_per_node})
    with pytest.raises(UserInputError, match="cluster.gpus_per_node=2, but torch on .* no CUDA"):
        PolicyWorkerBase(0, 2, policy_cfg, cluster, seed=0)
