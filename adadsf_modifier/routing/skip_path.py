"""What a token that skips a routed layer gets instead of the layer: a cheap affine map.

Paper-faithful AdaDSF passes a skipped token through unchanged (``identity``). A
:class:`SkipPath` instead adds ``u(x) = x W^T + b`` (full rank) or ``u(x) = (x D^T) U^T
+ b`` (rank ``k``), an approximation of the layer's update ``layer(x) - x`` fitted in
closed form (ridge regression, :func:`fit_ridge`) on calibration activations: no
gradient training. It runs on every token that skips the layer (the FLOPs model counts
``2 h^2`` or ``4 h k`` per such token), never on the tokens that run it.

The map is not an ``nn.Linear`` on purpose: a quantization recipe targeting ``Linear``
cannot reach it (it is fitted to the float activations and is a rounding error of the
model's size); :mod:`adadsf_modifier.recipe_checks` refuses recipes that name it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adadsf_modifier import distributed

__all__ = [
    "RIDGE_GRID",
    "SKIP_PATHS",
    "RidgeStats",
    "RidgeFit",
    "SkipPath",
    "choose_ridge",
    "fit_ridge",
    "fit_ridge_on_folds",
    "held_out_errors",
    "install_skip_path",
    "ridge_folds",
    "skip_path_of",
]

#: What a skipped token gets: ``identity`` (the input, as in the paper) or ``ridge``
#: (the input plus a fitted affine map of it).
SKIP_PATHS = ("identity", "ridge")
#: Relative ridge penalties :func:`choose_ridge` tries.
RIDGE_GRID = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class SkipPath(nn.Module):
    """The affine update a skipped token receives: ``[.., h] -> [.., h]``.

    ``rank=None``: full rank (``weight [h, h]``, ``bias [h]``); else ``down [k, h]``,
    ``up [h, k]``, ``bias [h]``. Starts at zero, i.e. as the identity skip path.
    """

    def __init__(self, hidden_size: int, rank: int | None = None):
        super().__init__()
        if rank is not None and not 0 < int(rank) < int(hidden_size):
            raise ValueError(
                f"skip path rank must be in [1, hidden_size - 1 = {hidden_size - 1}] "
                f"(null for full rank), got {rank}"
            )
        self.hidden_size = int(hidden_size)
        self.rank = None if rank is None else int(rank)
        h = self.hidden_size
        if self.rank is None:
            self.weight = nn.Parameter(torch.zeros(h, h))
        else:
            self.down = nn.Parameter(torch.zeros(self.rank, h))
            self.up = nn.Parameter(torch.zeros(h, self.rank))
        self.bias = nn.Parameter(torch.zeros(h))

    @staticmethod
    def flops_for(tokens: int, hidden_size: int, rank: int | None) -> int:
        """``2 n h^2`` (full rank) or ``2 n 2 h k`` (rank ``k``): matmuls only."""
        h = int(hidden_size)
        per_token = h * h if rank is None else 2 * h * int(rank)
        return 2 * int(tokens) * per_token

    def flops(self, tokens: int) -> int:
        """:meth:`flops_for` this map's shape."""
        return self.flops_for(tokens, self.hidden_size, self.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update ``u(x)`` (not ``x + u(x)``), in ``x``'s dtype."""
        dtype = x.dtype
        if dtype != self.bias.dtype:
            x = x.to(self.bias.dtype)
        if self.rank is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = F.linear(F.linear(x, self.down), self.up, self.bias)
        return out if out.dtype == dtype else out.to(dtype)

    @torch.no_grad()
    def load_fit(self, fit: RidgeFit) -> None:
        """Copy a :class:`RidgeFit` of the same shape into this map."""
        if fit.rank != self.rank or fit.bias.shape[0] != self.hidden_size:
            raise ValueError(
                f"a rank-{fit.rank} fit of width {fit.bias.shape[0]} does not fit a "
                f"rank-{self.rank} skip path of width {self.hidden_size}"
            )
        self.bias.copy_(fit.bias)
        if self.rank is None:
            self.weight.copy_(fit.weight)
        else:
            self.down.copy_(fit.down)
            self.up.copy_(fit.up)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, rank={self.rank}"


def skip_path_of(layer: nn.Module) -> SkipPath | None:
    """The layer's :class:`SkipPath` child, or ``None`` (identity skip path)."""
    module = layer._modules.get("skip_path")
    return module if isinstance(module, SkipPath) else None


def install_skip_path(layer: nn.Module, hidden_size: int, rank: int | None) -> SkipPath:
    """Give ``layer`` a zero (identity) :class:`SkipPath` on the device and in the
    dtype of the layer's own weights (its first parameter: the router and skip path are
    registered after them). Not the router's: an FTP router may own no parameter (one
    MLP is shared) or train in float32."""
    param = next(layer.parameters())
    dtype = param.dtype if param.is_floating_point() else None
    skip = SkipPath(int(hidden_size), rank).to(device=param.device, dtype=dtype)
    layer.add_module("skip_path", skip)
    return skip


class RidgeStats:
    """Running sums (float64) for regressing updates ``y`` on inputs ``x``.

    Enough for the centred normal equations, so no token is stored: ``n``, ``sum x``,
    ``sum y``, ``sum x x^T``, ``sum x y^T`` and ``sum |y|^2``.
    """

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu"):
        h = int(hidden_size)
        kw = {"dtype": torch.float64, "device": device}
        self.n = 0
        self.sx = torch.zeros(h, **kw)
        self.sy = torch.zeros(h, **kw)
        self.sxx = torch.zeros(h, h, **kw)
        self.sxy = torch.zeros(h, h, **kw)
        self.syy = 0.0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add tokens ``x [n, h]`` with targets ``y [n, h]``."""
        if x.shape[0] == 0:
            return
        x = x.to(self.sx.device, torch.float64)
        y = y.to(self.sx.device, torch.float64)
        self.n += int(x.shape[0])
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y
        self.syy += float((y * y).sum())

    def all_reduce(self) -> None:
        """Sum these statistics over the ranks under ``torchrun`` (in place; nothing
        in one process), so every rank fits the same map on every partition."""
        if not distributed.is_distributed():
            return
        for name in ("sx", "sy", "sxx", "sxy"):
            setattr(self, name, distributed.sum_across_ranks(getattr(self, name)))
        (self.n,) = distributed.sum_across_ranks([int(self.n)])
        (self.syy,) = distributed.sum_across_ranks([float(self.syy)])

    def __add__(self, other: RidgeStats) -> RidgeStats:
        out = RidgeStats(self.sx.shape[0], self.sx.device)
        out.n, out.syy = self.n + other.n, self.syy + other.syy
        for name in ("sx", "sy", "sxx", "sxy"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def squared_error(self, weight: torch.Tensor, bias: torch.Tensor) -> float:
        """``sum |y - x W - b|^2`` over these tokens, ``weight [h_in, h_out]``."""
        return (
            self.syy
            - 2 * float((weight * self.sxy).sum())
            - 2 * float(bias @ self.sy)
            + float((weight * (self.sxx @ weight)).sum())
            + 2 * float((self.sx @ weight) @ bias)
            + self.n * float(bias @ bias)
        )


@dataclass
class RidgeFit:
    """A fitted skip path (float64): ``weight [h, h]`` or ``down``/``up``, and
    ``bias``.

    ``r2``: fraction of the fit tokens' update variance it explains (uncentred: the
    identity skip path has ``r2 = 0``); ``tokens``: how many tokens it was fit on.
    """

    bias: torch.Tensor
    weight: torch.Tensor | None = None
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    rank: int | None = None
    r2: float = float("nan")
    tokens: int = 0
    ridge: float = float("nan")

    @property
    def matrix(self) -> torch.Tensor:
        """The map's ``[h_in, h_out]`` matrix (``x @ matrix + bias``)."""
        return self.weight.T if self.rank is None else self.down.T @ self.up.T


def choose_ridge(
    folds: tuple[RidgeStats, RidgeStats],
    rank: int | None = None,
    grid: tuple[float, ...] = RIDGE_GRID,
) -> float:
    """The relative ridge penalty of ``grid`` with the least two-fold held-out error
    (fit on one fold, measured on the other, both ways). Ties go to the larger one."""
    errors = held_out_errors(folds, rank, grid)
    return -min(zip(errors, (-r for r in grid)))[1]


def held_out_errors(
    folds: tuple[RidgeStats, RidgeStats],
    rank: int | None = None,
    grid: tuple[float, ...] = RIDGE_GRID,
) -> list[float]:
    """Per penalty of ``grid``: the squared error on each fold of :func:`fit_ridge` fit
    on the other, summed over both ways.

    The same fits as :func:`fit_ridge`, cheaper over a grid: each fold's input
    covariance is diagonalised once, ``C = Q diag(l) Q^T``, so a penalty's solution is
    ``Q diag(1 / (l + lam)) Q^T C_xy`` and its fitted-value covariance
    ``P^T diag(l / (l + lam)^2) P`` (``P = Q^T C_xy``) without a new solve. Choosing a
    rank-64 map's penalty is most of a ridge run's calibration in ``adadsf study
    --quick`` (~1.5 s a layer and fit, 29 layers, three fits a run, at h = 576 on one
    CPU thread); this takes 0.70 of that on one thread, 0.77 on two, the per-penalty
    ``eigh`` of the fitted values being most of the rest.
    """
    errors = [0.0] * len(grid)
    for fit_on, test_on in (folds, folds[::-1]):
        mx, my, cxx, cxy = _centred(fit_on)
        evals, q = torch.linalg.eigh(cxx)
        proj = q.T @ cxy
        scale = _penalty_scale(cxx)
        for i, ridge in enumerate(grid):
            inv = 1.0 / (evals + float(ridge) * scale)
            w = q @ (proj * inv[:, None])
            if rank is not None:
                fitted = proj.T @ (proj * (evals * inv * inv)[:, None])
                v = _top_eigenvectors(fitted, int(rank))
                w = (w @ v) @ v.T
            errors[i] += test_on.squared_error(w, my - mx @ w)
    return errors


def _centred(stats: RidgeStats) -> tuple[torch.Tensor, ...]:
    """Means of ``x`` and ``y`` and the centred sums ``C_xx``, ``C_xy`` of ``stats``."""
    if stats.n == 0:
        raise ValueError("no tokens to fit a skip path on")
    n = stats.n
    mx, my = stats.sx / n, stats.sy / n
    cxx = stats.sxx - n * torch.outer(mx, mx)
    cxy = stats.sxy - n * torch.outer(mx, my)
    return mx, my, cxx, cxy


def _penalty_scale(cxx: torch.Tensor) -> float:
    """What a relative ridge penalty multiplies: the mean input variance sum."""
    return float(cxx.diagonal().mean().clamp(min=1e-12))


def _top_eigenvectors(sym: torch.Tensor, k: int) -> torch.Tensor:
    """The eigenvectors of the ``k`` largest eigenvalues of a symmetric matrix,
    ``[h, k]``, ascending. A full ``torch.linalg.eigh``: LAPACK's subset solver
    (``scipy.linalg.eigh(subset_by_index=...)``) took 24 ms against 43 at h = 576 on one
    thread, but on two its OpenBLAS threads ran slower than torch's and kept spinning
    into the torch matmuls after them (1.5x slower), a net loss in a model's process."""
    return torch.linalg.eigh(0.5 * (sym + sym.T))[1][:, -k:]


def ridge_folds(
    real: torch.Tensor, rows_seen: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-fold split of a batch's real tokens for choosing the ridge penalty
    (:func:`choose_ridge`): whole rows alternate between the folds (neighbouring
    tokens are alike, rows much less); a lone row alternates tokens. ``rows_seen``:
    rows of earlier batches, so the alternation runs on across batches."""
    batch, seq = real.shape
    if rows_seen == 0 and batch == 1:
        odd = (torch.arange(seq, device=real.device) % 2 == 1).expand(batch, seq)
    else:
        rows = torch.arange(batch, device=real.device) + rows_seen
        odd = (rows % 2 == 1).unsqueeze(1).expand(batch, seq)
    return real & ~odd, real & odd


def fit_ridge_on_folds(
    folds: tuple[RidgeStats, RidgeStats],
    rank: int | None = None,
    ridge: float | str = "auto",
) -> RidgeFit:
    """:func:`fit_ridge` on both folds' tokens; ``ridge`` ``auto``: the penalty
    :func:`choose_ridge` picks on them (1e-3 when a fold has too few tokens to hold
    out)."""
    if ridge == "auto":
        ridge = choose_ridge(folds, rank) if min(f.n for f in folds) > 1 else 1e-3
    return fit_ridge(folds[0] + folds[1], rank, float(ridge))


def fit_ridge(
    stats: RidgeStats, rank: int | None = None, ridge: float = 1e-3
) -> RidgeFit:
    """Closed-form ridge regression of ``y`` on ``[x, 1]`` (unpenalised intercept).

    ``lambda = ridge * mean(diag(C_xx))`` with ``C_xx`` the centred input covariance
    sum, so ``ridge`` is scale-free (the residual stream's scale grows with depth).
    With ``rank``: reduced-rank ridge regression, the full solution projected onto the
    top-``rank`` principal directions of its fitted values (``W V_k V_k^T``), which is
    the best rank-``k`` map for the same penalised fit.
    """
    mx, my, cxx, cxy = _centred(stats)
    n, h = stats.n, cxx.shape[0]
    lam = float(ridge) * _penalty_scale(cxx)
    eye = torch.eye(h, dtype=cxx.dtype, device=cxx.device)
    w = torch.linalg.solve(cxx + lam * eye, cxy)  # [h_in, h_out]: y ~ (x - mx) w + my
    down = up = None
    if rank is not None:
        v = _top_eigenvectors(w.T @ cxx @ w, int(rank))  # of the fitted values
        w = w @ v @ v.T
        down = (w @ v).T.contiguous()  # [k, h_in]
        up = v.contiguous()  # [h_out, k]
    bias = my - mx @ w
    # residual sum of squares from the sums: y - x w - b = (y - my) - (x - mx) w
    resid = (
        stats.syy
        - n * float(my @ my)
        - 2 * float((w * cxy).sum())
        + float((w * (cxx @ w)).sum())
    )
    r2 = 1.0 - resid / stats.syy if stats.syy > 0 else float("nan")
    return RidgeFit(
        bias=bias,
        weight=None if rank is not None else w.T.contiguous(),
        down=down,
        up=up,
        rank=None if rank is None else int(rank),
        r2=r2,
        tokens=n,
        ridge=float(ridge),
    )
