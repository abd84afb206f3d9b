"""The GPU checks that need torchrec: its DLRM on ROBE-Z tables trained eagerly, twice
deterministically, and compiled with CUDA graphs; a sequence lookup compiled; a VBE batch
padded without a wait for the device. Run by ``benchmarks.gpu_check`` after the checks of
:mod:`robe_torchrec.testing.gpu_checks`, and on the CPU by ``tests/test_gpu_dlrm_checks.py``
(nothing is captured there: the checks' own plumbing is what is tested).

Example::

    >>> for name, check in torchrec_gpu_checks():
    ...     check()                      # raises AssertionError naming what differs
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from robe_torchrec.ops import raise_pending_checks
from robe_torchrec.testing.gpu_checks import (check_dense_capturable_adam,
                                              deterministic_algorithms, no_host_sync)


# ---------------------------------------------------------------------------------------
# TorchRec's DLRM compiled with CUDA graphs (needs torchrec; fbgemm's sparse ops on CUDA)
# ---------------------------------------------------------------------------------------

class DlrmRun(NamedTuple):
    """What a few DLRM training steps leave: each step's loss, and the fused optimizer's
    tensors at the end (the ROBE array, its state, its step count), on the CPU."""
    losses: List[float]
    fused: Dict[str, torch.Tensor]


def _shim_fbgemm(device: str) -> None:
    """On CUDA, CUDA kernels for fbgemm's sparse ops where fbgemm has none (fbgemm-gpu-cpu,
    what this project's GPU machines have)."""
    if torch.device(device).type == "cuda":
        from robe_torchrec.testing import fbgemm_cuda_shim

        fbgemm_cuda_shim.install()


def dlrm_run(steps: int, device: str = "cuda", compile_kwargs: Optional[dict] = None
             ) -> DlrmRun:
    """``steps`` steps of TorchRec's DLRM on ROBE-Z tables with fused Adagrad (SGD for the
    dense part), eager or under ``torch.compile(**compile_kwargs)``; the same model and
    batches every call. The fused rate warms up, a new float written into its param group
    before every step, as TorchRec's ``WarmupOptimizer`` writes it: a captured backward
    must read each (a compiled one, without recompiling)."""
    from robe_torchrec.config import RobeConfig
    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.dlrm import DLRMSpec, OptimizerSpec, build_dlrm, dense_optimizer
    from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection

    _shim_fbgemm(device)
    data = SyntheticCriteo(batch_size=256, num_sparse=8, cardinality_scale=1e-2)
    spec = DLRMSpec(robe=RobeConfig(compression=100, block_size=8), embedding_dim=16,
                    embedding_optimizer=OptimizerSpec("adagrad", lr=0.05),
                    dense_optimizer=OptimizerSpec("sgd", lr=0.1))
    torch.manual_seed(0)
    model, _ = build_dlrm(spec, data.keys, data.cardinalities)
    model = model.to(device)
    dense = dense_optimizer(model, spec.dense_optimizer.cls, spec.dense_optimizer.kwargs())
    step_model = model if compile_kwargs is None else torch.compile(model, **compile_kwargs)
    fused = next(m for m in model.modules()
                 if isinstance(m, RobeEmbeddingBagCollection)).fused_optimizer
    losses = []
    for step, batch in enumerate(data.batches(0, steps)):
        fused.param_groups[0]["lr"] = 0.05 * (step + 1) / steps
        batch = batch.to(torch.device(device))
        dense.zero_grad()
        loss, _ = step_model(batch)
        loss.backward()
        dense.step()
        losses.append(float(loss.detach()))
    raise_pending_checks()
    tensors = {"weight": fused.param}
    tensors.update(fused.param_state)
    return DlrmRun(losses, {k: v.detach().cpu().clone() for k, v in tensors.items()})


def _bitwise_differences(a: DlrmRun, b: DlrmRun) -> List[str]:
    """What differs, bit for bit, between two runs (empty: nothing)."""
    differ = [f"loss at step {i}: {x!r} against {y!r}"
              for i, (x, y) in enumerate(zip(a.losses, b.losses)) if x != y][:3]
    return differ + [f"fused {name}" for name, t in a.fused.items()
                     if not torch.equal(t, b.fused[name])]


def check_compiled_dlrm(steps: int = 20, device: str = "cuda",
                        require_graphs: bool = True) -> None:
    """TorchRec's DLRM on ROBE-Z tables with fused Adagrad trains under CUDA graphs as it
    does eagerly, for ``steps`` steps, under ``torch.use_deterministic_algorithms(True)``
    (float atomics would make even two eager runs differ where ids collide):

    * ``torch.compile(mode="reduce-overhead")`` (Inductor's kernels, in CUDA graphs) gives
      every loss, the ROBE array and its optimizer state bitwise equal to ``torch.compile``
      without graphs (the same kernels, launched one by one): what CUDA graphs alone change
      is nothing;
    * and within 1e-5 of eager's losses: Inductor fuses the dense layers' float arithmetic
      in another order, which changes the last bits however the graphs run;
    * every run counts ``steps`` in the fused optimizer's step (a replay that repeated a
      captured count would freeze it);
    * the fused rate changes every step (:func:`dlrm_run`): a replay that kept the
      captured rate would differ from eager.

    ``require_graphs``: a graph that Inductor or the backend would run without a CUDA graph
    fails the check, with the reason (``torch._inductor.config.triton.cudagraph_or_error``);
    off on the CPU, where nothing is captured and the check tests its own plumbing."""
    import torch._inductor.config as inductor_config

    with deterministic_algorithms():
        eager = dlrm_run(steps, device)
        compiled = dlrm_run(steps, device, {})
        with inductor_config.patch({"triton.cudagraph_or_error": require_graphs}):
            graphed = dlrm_run(steps, device, dict(mode="reduce-overhead"))
    worst = max(abs(a - b) for a, b in zip(eager.losses, graphed.losses))
    differences = _bitwise_differences(compiled, graphed)
    print(f"    compiled DLRM, {steps} steps: reduce-overhead bitwise the graphless "
          f"compile's: {not differences}; worst loss difference from eager {worst:.3g}",
          flush=True)
    assert not differences, f"reduce-overhead against the graphless compile: {differences}"
    assert worst <= 1e-5, (eager.losses, graphed.losses)
    for name, run in (("eager", eager), ("compiled", compiled), ("reduce-overhead", graphed)):
        counted = float(run.fused["step"])
        assert counted == steps, f"{name}: the fused optimizer counted {counted} of {steps} steps"


def check_deterministic_dlrm(steps: int = 20, device: str = "cuda") -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` two eager runs of the DLRM train
    to the same losses and fused state, bit for bit (the ROBE backward sums in a fixed order;
    cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which benchmarks/gpu_session.sh sets)."""
    with deterministic_algorithms():
        first, second = dlrm_run(steps, device), dlrm_run(steps, device)
    differences = _bitwise_differences(first, second)
    assert not differences, differences


#: the sequence check's tables (rows) and each feature's ids a sample: skewed, as sequence
#: features are (a history, a few context ids, one candidate)
_SEQUENCE_ROWS, _SEQUENCE_IDS = (1000, 300, 50), (5, 2, 1)


def sequence_run(steps: int, device: str = "cuda", compile_kwargs: Optional[dict] = None
                 ) -> Tuple[List[float], torch.Tensor]:
    """``steps`` steps of a ``RobeEmbeddingCollection`` (three tables on one array, so
    that a traced graph makes the ids keys in ``robe::unpooled_keys``) with fused Adagrad,
    eager or under ``torch.compile(**compile_kwargs)``, on batches of one shape (their
    lengths per key read on the host, as ``from_lengths_sync`` does, so that a graph can be
    replayed); returns each step's loss and the array at the end, on the CPU."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.optim import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from robe_torchrec.config import RobeConfig
    from robe_torchrec.embedding_collection import RobeEmbeddingCollection

    _shim_fbgemm(device)  # its own: `--only compiled_sequence` runs no DLRM check first
    batch = 8
    tables = [EmbeddingConfig(name=f"t{t}", embedding_dim=16, num_embeddings=rows,
                              feature_names=[f"f{t}"])
              for t, rows in enumerate(_SEQUENCE_ROWS)]
    torch.manual_seed(0)
    ec = RobeEmbeddingCollection(tables, RobeConfig(compression=20, block_size=8),
                                 device=device)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ec.weight], {"lr": 0.05})

    def loss_of(kjt):
        return sum((jt.values() ** 2).sum() for jt in ec(kjt).values())

    step = loss_of if compile_kwargs is None else torch.compile(loss_of, **compile_kwargs)
    lengths = torch.tensor([n for n in _SEQUENCE_IDS for _ in range(batch)])
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        values = torch.cat([torch.randint(0, rows, (n * batch,), generator=g)
                            for rows, n in zip(_SEQUENCE_ROWS, _SEQUENCE_IDS)])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(len(tables))], values=values.to(device),
            lengths=lengths.to(device))
        loss = step(kjt)
        loss.backward()
        losses.append(float(loss.detach()))
    raise_pending_checks()
    return losses, ec.weight.detach().cpu().clone()


def check_compiled_sequence_lookup(steps: int = 5, device: str = "cuda") -> None:
    """A ``RobeEmbeddingCollection`` trains under ``torch.compile(fullgraph=True)`` and
    under ``mode="reduce-overhead"`` as it does eagerly, with fused Adagrad, under
    ``torch.use_deterministic_algorithms(True)``: every loss within 1e-5 (relative) of
    eager's and the array within 1e-6. The traced graphs make the ids keys in
    ``robe::unpooled_keys``, whose kernel copies the counts to the device: tagged
    ``cudagraph_unsafe``, it must run outside Inductor's CUDA graphs, where a capture would
    refuse the copy."""
    import torch._inductor.config as inductor_config

    # with graph partitions (Inductor's default) the op runs outside the graphs and the
    # rest must be captured; without, the whole graph is left out, by design
    require_graphs = device != "cpu" and bool(getattr(inductor_config, "graph_partition",
                                                      False))
    with deterministic_algorithms():
        eager = sequence_run(steps, device)
        fullgraph = sequence_run(steps, device, dict(fullgraph=True))
        with inductor_config.patch({"triton.cudagraph_or_error": require_graphs}):
            graphed = sequence_run(steps, device, dict(mode="reduce-overhead"))
    compiled = {"fullgraph": fullgraph, "reduce-overhead": graphed}
    for name, (losses, weight) in compiled.items():
        worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(eager[0], losses))
        print(f"    compiled sequence lookup ({name}), {steps} steps: worst relative loss "
              f"difference {worst:.3g}", flush=True)
        assert worst <= 1e-5, (name, eager[0], losses)
        torch.testing.assert_close(weight, eager[1], rtol=1e-5, atol=1e-6, msg=name)


def check_vbe_padding_no_host_sync(device: str = "cuda") -> None:
    """A KJT with a variable batch size per feature (VBE), padded to its largest stride as
    the pooled module pads it (``robe_torchrec/variable_batch.py``), under
    ``torch.cuda.set_sync_debug_mode("error")``: no wait for the device, and the padded
    lengths are those of the same KJT padded on the CPU. Runs on CPU tensors too."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from robe_torchrec.variable_batch import pad_variable_strides

    strides = [3, 1, 4]
    lengths = torch.tensor([2, 0, 1, 3, 1, 1, 0, 2])
    values = torch.arange(int(lengths.sum()))

    def padded(on: torch.device) -> torch.Tensor:
        # the inputs copied to the device first: a copy from pageable memory waits for it
        kjt_values, kjt_lengths = values.to(on), lengths.to(on)
        with no_host_sync() if on.type == "cuda" else contextlib.nullcontext():
            kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=kjt_values,
                                    lengths=kjt_lengths,
                                    stride_per_key_per_rank=[[s] for s in strides])
            return pad_variable_strides(kjt).lengths()

    want = torch.tensor([2, 0, 1, 0, 3, 0, 0, 0, 1, 1, 0, 2])
    assert torch.equal(padded(torch.device("cpu")), want)
    on = torch.device(device)
    padded(on)  # a first call may set up what later ones reuse
    got = padded(on)
    assert torch.equal(got.cpu(), want), got


def torchrec_gpu_checks() -> List[Tuple[str, Callable[[], None]]]:
    """The checks that need torchrec on the GPU (none when it is not importable)."""
    import importlib.util

    if importlib.util.find_spec("torchrec") is None:
        return []
    return [("vbe_padding_no_host_sync", check_vbe_padding_no_host_sync),
            ("dense_capturable_adam", check_dense_capturable_adam),
            ("deterministic_dlrm", check_deterministic_dlrm),
            ("compiled_dlrm_reduce_overhead", check_compiled_dlrm),
            ("compiled_sequence_lookup", check_compiled_sequence_lookup)]
