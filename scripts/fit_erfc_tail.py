"""Fits the polynomial of the bfloat16 units' normal tail (csrc/cpu/vector_math.h,
v_erfc_tail_poly): erfc(a) = t q(t) exp(-a^2) with t = 1 / (1 + P a), q of degree DEGREE,
for the least relative error over a in [0, A_MAX] (past it exp(-a^2) is no normal float),
by least squares, each round weighted by the last round's residuals so that the largest
errors shrink towards an even, near-minimax spread. Prints the coefficients, lowest degree
first, and the fit's worst relative error in float64:

    python scripts/fit_erfc_tail.py"""

from __future__ import annotations

import torch

P = 0.3275911  # Abramowitz-Stegun 7.1.26's t, which v_erfc_t computes
DEGREE = 7
A_MAX = 9.5
ROUNDS = 200


def fit() -> tuple[torch.Tensor, float]:
    a = torch.linspace(0.0, A_MAX, 40001, dtype=torch.float64)
    t = 1.0 / (1.0 + P * a)
    target = torch.special.erfcx(a) / t  # q(t) exactly
    # relative residual q(t) / target - 1, linear in q's coefficients
    basis = torch.vander(t, DEGREE + 1, increasing=True) / target[:, None]
    weights = torch.ones_like(t)
    for _ in range(ROUNDS):
        solution = torch.linalg.lstsq(basis * weights[:, None], weights[:, None]).solution
        residual = (basis @ solution).squeeze(1) - 1.0
        weights = (residual.abs() / residual.abs().max() + 1e-4).sqrt()
    coefficients = solution.squeeze(1)
    return coefficients, float(residual.abs().max())


def main() -> None:
    coefficients, worst = fit()
    print(", ".join(f"{float(c):.9e}f" for c in coefficients.float()))
    print(f"worst relative error {worst:.2e}")


if __name__ == "__main__":
    main()
