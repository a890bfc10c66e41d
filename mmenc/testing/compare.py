"""Comparing tensors and tower outputs with relative error; failures print the error and the tolerance."""
import torch


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> float:
    """Raise AssertionError unless shapes match and relative_error(got, want) < tol; returns the error."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    err = relative_error(got, want)
    assert err < tol, f"{what}: relative error {err:.2e} exceeds tolerance {tol:.0e}"
    return err


def assert_same_output(got, want, what: str, tol: float = 1e-5) -> None:
    """Two TowerOutputs agree: embeddings and every extra (a tensor, a list of tensors, or a value
    compared with ==) within `tol` relative error."""
    assert_close(got.embeddings, want.embeddings, f"{what} embeddings", tol)
    assert got.extras.keys() == want.extras.keys(), f"{what}: extras {sorted(got.extras)} != {sorted(want.extras)}"
    for key, value in want.extras.items():
        if isinstance(value, torch.Tensor):
            assert_close(got.extras[key], value, f"{what} extras[{key!r}]", tol)
        elif isinstance(value, (list, tuple)):
            assert len(got.extras[key]) == len(value), f"{what} extras[{key!r}]: {len(got.extras[key])} items " \
                                                       f"!= {len(value)}"
            for i, (g, w) in enumerate(zip(got.extras[key], value)):
                assert_close(g, w, f"{what} extras[{key!r}][{i}]", tol)
        else:
            assert got.extras[key] == value, f"{what} extras[{key!r}]: {got.extras[key]!r} != {value!r}"
