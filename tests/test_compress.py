"""Compressing trained tables into a ROBE array (robe_torchrec.compress): the fit equals a
brute-force least-squares solve over the hash's 0/1 design matrix, counts weight it, and the
tables of a DCP checkpoint written by the app load in one process."""


import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.compress import least_squares_array

TABLES = [(7, 6), (5, 6), (9, 3)]  # (rows, dim): dims not multiples of Z = 4


def trained_ebc(seed: int = 0) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=n,
                           feature_names=[f"f{i}"]) for i, (n, d) in enumerate(TABLES)])
    with torch.no_grad():
        for p in ebc.parameters():
            p.normal_()
    return ebc


def every_row(ebc) -> torch.Tensor:
    """Each table's rows as the module reads them, flattened in (table, row, column) order."""
    out = []
    for i, (n, _) in enumerate(TABLES):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{j}" for j in range(len(TABLES))],
            values=torch.arange(n),
            lengths=torch.tensor([1 if j == i else 0 for j in range(len(TABLES)) for _ in range(n)]))
        out.append(ebc(kjt)[f"f{i}"].reshape(-1))
    return torch.cat(out)


def brute_force(robe_ebc, full, counts=None) -> torch.Tensor:
    """argmin_W ||sqrt(c) * (A W - E)|| over the design matrix A, built by looking every row up
    with W = each unit vector in turn (no hashing code shared with the module under test);
    gelsd: the minimum-norm solution where slots are unused."""
    m = robe_ebc.memory_size
    columns = []
    with torch.no_grad():
        for k in range(m):
            robe_ebc.weight.zero_()
            robe_ebc.weight[k] = 1.0
            columns.append(every_row(robe_ebc))
    design = torch.stack(columns, 1).double()
    assert set(design.unique().tolist()) <= {0.0, 1.0} and bool((design.sum(1) == 1).all())
    target = every_row(full).detach().double()
    w = torch.ones_like(target) if counts is None else torch.cat(
        [counts[f"t{i}"].double().repeat_interleave(d) for i, (_, d) in enumerate(TABLES)])
    solution = torch.linalg.lstsq(design * w.sqrt()[:, None], (target * w.sqrt())[:, None],
                                  driver="gelsd").solution
    return solution.squeeze(1).float()


@pytest.mark.parametrize("shared, hash_mode", [(True, "reference"), (False, "mix")])
def test_fit_is_the_least_squares_solution(shared, hash_mode):
    full = trained_ebc()
    config = RobeConfig(memory_size=24 if shared else 40, block_size=4, hash=hash_mode,
                        shared=shared, seed=7)
    counts = {f"t{i}": torch.randint(0, 5, (n,)).float() for i, (n, _) in enumerate(TABLES)}
    for id_counts in (None, counts):
        robe = RobeEmbeddingBagCollection.from_embedding_bag_collection(full, config, id_counts)
        assert robe.memory_size == config.memory_size
        fitted = robe.weight.detach().clone()
        expected = brute_force(robe, full, id_counts)
        torch.testing.assert_close(fitted, expected, atol=1e-5, rtol=1e-5)


def test_counts_make_the_frequent_rows_win_the_collisions():
    full = trained_ebc(1)
    config = RobeConfig(memory_size=48, block_size=4, seed=3)
    counts = {f"t{i}": torch.ones(n) for i, (n, _) in enumerate(TABLES)}
    counts["t0"][2] = 1000.0
    error = {}
    for name, id_counts in (("uniform", None), ("counted", counts)):
        robe = RobeEmbeddingBagCollection.from_embedding_bag_collection(full, config, id_counts)
        error[name] = (every_row(robe) - every_row(full))[2 * 6:3 * 6].abs().max().item()
    # row 2 of t0 is reproduced almost exactly once it dominates its slots
    assert error["counted"] < 0.01 < error["uniform"]


def test_bad_inputs_are_named():
    full = trained_ebc()
    config = RobeConfig(memory_size=24, block_size=4)
    with pytest.raises(ValueError, match="no entry for table 't1'"):
        RobeEmbeddingBagCollection.from_embedding_bag_collection(full, config,
                                                                 {"t0": torch.ones(7)})
    counts = {f"t{i}": torch.ones(n) for i, (n, _) in enumerate(TABLES)}
    counts["t2"] = -counts["t2"]
    with pytest.raises(ValueError, match=r"id_counts\['t2'\] must be finite and >= 0"):
        RobeEmbeddingBagCollection.from_embedding_bag_collection(full, config, counts)
    counts["t2"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"shape \(3,\), expected \(9,\)"):
        RobeEmbeddingBagCollection.from_embedding_bag_collection(full, config, counts)
    robe = RobeEmbeddingBagCollection.from_embedding_bag_collection(full, config)
    with pytest.raises(ValueError, match="table 't0': trained weight has shape"):
        least_squares_array(robe.layout, {f"t{i}": torch.zeros(2, 2) for i in range(3)})
