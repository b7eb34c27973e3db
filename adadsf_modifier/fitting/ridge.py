"""The ridge maths of a fitted skip path: closed-form ridge regression of a layer's
update ``layer(x) - x`` on its input ``x``, from running sums, with the penalty chosen
by two-fold held-out error.

:class:`RidgeStats` accumulates the sums (float64, no token stored), :func:`fit_ridge`
solves the centred normal equations (full rank, or reduced rank ``k``) into a
:class:`RidgeFit`, and :func:`choose_ridge` picks the relative penalty of
:data:`RIDGE_GRID` on two folds (:func:`ridge_folds`). The map these fits fill is
:class:`~adadsf_modifier.routing.skip_path.SkipPath`; fitting every layer's map on
calibration activations is :mod:`~adadsf_modifier.fitting.skip_fit`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adadsf_modifier import distributed

__all__ = [
    "RIDGE_GRID",
    "RidgeStats",
    "RidgeFit",
    "choose_ridge",
    "fit_ridge",
    "fit_ridge_on_folds",
    "held_out_errors",
    "ridge_folds",
]

#: Relative ridge penalties :func:`choose_ridge` tries.
RIDGE_GRID = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


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
    ``W = Q M`` with ``M = diag(1 / (l + lam)) P`` (``P = Q^T C_xy``) and its
    fitted-value covariance ``P^T diag(l / (l + lam)^2) P``, without a new solve. The
    other fold's sums are turned into that eigenbasis once (:class:`_HeldOut`), so a
    penalty's error costs one ``h^3`` product at full rank. At rank ``k`` the error
    itself is ``h^2 k``, and so are the penalty's top fitted-value directions, but for
    the first penalty's (:func:`_leading_fitted_directions`): a layer's search covers
    14 fits, and at a 1B model's width ``h^3`` work per fit would dominate it.

    At rank ``k`` the directions are computed in float32 and the rest in float64: the
    errors carry the directions' residual (:func:`_leading_fitted_directions`), which
    can only change the choice between penalties whose errors tie to that precision.
    The fit of the chosen penalty is all float64.
    """
    errors = [0.0] * len(grid)
    for fit_on, test_on in (folds, folds[::-1]):
        mx, my, cxx, cxy = _centred(fit_on)
        evals, q = torch.linalg.eigh(cxx)
        proj = q.T @ cxy
        scale = _penalty_scale(cxx)
        held_out = _HeldOut(test_on, q, mx, my)
        block = None  # the last penalty's leading fitted-value directions
        for i, ridge in enumerate(grid):
            inv = 1.0 / (evals + float(ridge) * scale)
            m = proj * inv[:, None]  # W = Q M
            if rank is None:
                errors[i] += held_out.squared_error(m)
                continue
            v, block = _leading_fitted_directions(
                proj, evals * inv * inv, int(rank), block
            )
            errors[i] += held_out.squared_error(m @ v, v)  # W V V^T = Q (M V) V^T
    return errors


#: The penalty search refines a penalty's top fitted-value directions until their
#: residual is at most this fraction of the eigenvalue gap past them
#: (:func:`_leading_fitted_directions`) ...
SEARCH_TOLERANCE = 0.1

#: ... and takes a full ``eigh`` instead after this many steps.
SEARCH_MAX_STEPS = 20

#: Directions the search tracks beyond the top ``k``: ``k`` of them, at least this
#: many.
SEARCH_OVERSAMPLING = 64


def _leading_fitted_directions(
    proj: torch.Tensor, weights: torch.Tensor, k: int, block: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` eigenvectors of the fitted-value covariance ``F = P^T diag(w) P``
    (``[h, k]``, ascending, float64) for :func:`held_out_errors`, and the leading
    directions to start the next penalty from (float32, ``k`` more than asked and at
    least :data:`SEARCH_OVERSAMPLING` more).

    The grid's first penalty (``block`` None) gets a full float32 ``eigh`` of ``F``.
    A later one starts from the previous penalty's leading directions, which
    the new weights move only a little, and refines them by subspace iteration on
    ``G = diag(sqrt(w)) P`` (``F = G^T G``, never formed) with a Rayleigh-Ritz step
    each time. A step is ``O(h^2 k)`` where the covariance and its ``eigh`` are
    ``O(h^3)``, the search's largest cost at a 1B model's width.

    It stops when the top ``k`` Ritz vectors' residual ``|F V - V diag(theta)|`` is at
    most :data:`SEARCH_TOLERANCE` times the gap between the ``k``-th and the next Ritz
    value: by Davis-Kahan (with that Ritz value standing in for the next eigenvalue)
    the subspace is then within about that angle of the exact one. Directions the gap
    leaves undetermined (a flat spectrum) do not settle, and get a full ``eigh`` after
    :data:`SEARCH_MAX_STEPS`. The errors so computed can differ from a fresh ``eigh``'s
    only far below the gaps between penalties, so the choice is the same. Where the
    tracked directions are all ``h``, one Rayleigh-Ritz step is exact. The fit of the
    chosen penalty (:func:`fit_ridge`) is a full float64 ``eigh``.
    """
    h = proj.shape[0]
    width = min(h, k + max(k, SEARCH_OVERSAMPLING))
    if block is not None and width > k:
        g = proj * weights.clamp(min=0).sqrt()[:, None]
        g = (g / g.abs().max().clamp(min=1e-300)).float()  # within float32's range
        for _ in range(SEARCH_MAX_STEPS):
            y = g @ block
            values, rotation = torch.linalg.eigh(y.T @ y)
            block = block @ rotation  # Ritz vectors, ascending
            step = g.T @ (y @ rotation)  # F V
            residual = (step[:, -k:] - block[:, -k:] * values[-k:]).norm()
            gap = values[-k] - values[-k - 1]
            if width == h or residual <= SEARCH_TOLERANCE * gap:
                return block[:, -k:].to(proj.dtype), block
            block = torch.linalg.qr(step)[0]
    fitted = proj.T @ (proj * weights[:, None])
    block = _top_eigenvectors(fitted, width, search=True).float()
    return block[:, -k:].to(proj.dtype), block


class _HeldOut:
    """A fold's sums in another fold's input eigenbasis ``Q``, for the squared error
    of maps ``W = Q A`` (or ``Q A V^T`` with orthonormal ``V``) with the intercept
    ``b = m_y - m_x W`` of the fold they were fit on (``mx``, ``my``):
    :meth:`RidgeStats.squared_error` without an ``h^3`` product per map."""

    def __init__(
        self, stats: RidgeStats, q: torch.Tensor, mx: torch.Tensor, my: torch.Tensor
    ):
        self.stats = stats
        self.sxx = q.T @ stats.sxx @ q
        self.sxy = q.T @ stats.sxy
        self.sx = stats.sx @ q
        self.mx, self.my = mx @ q, my

    def squared_error(self, a: torch.Tensor, v: torch.Tensor | None = None) -> float:
        """``sum |y - x W - b|^2`` over the fold for ``W = Q a`` (``v`` None) or
        ``W = Q a v^T``: every term of :meth:`RidgeStats.squared_error` with ``Q`` and
        ``v`` moved onto the fold's sums (``tr(v a^T S a v^T) = tr(a^T S a)`` as
        ``v^T v = I``)."""
        st = self.stats
        sxy = self.sxy if v is None else self.sxy @ v
        project = (lambda t: t) if v is None else (lambda t: t @ v.T)
        bias = self.my - project(self.mx @ a)
        return (
            st.syy
            - 2 * float((a * sxy).sum())
            - 2 * float(bias @ st.sy)
            + float((a * (self.sxx @ a)).sum())
            + 2 * float(project(self.sx @ a) @ bias)
            + st.n * float(bias @ bias)
        )


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


def _top_eigenvectors(sym: torch.Tensor, k: int, search: bool = False) -> torch.Tensor:
    """The eigenvectors of the ``k`` largest eigenvalues of a symmetric matrix,
    ``[h, k]``, ascending, in ``sym``'s dtype. A full ``torch.linalg.eigh``, not
    LAPACK's subset solver (``scipy.linalg.eigh(subset_by_index=...)``): that one's
    OpenBLAS threads keep spinning into the torch matmuls after them, a net loss in a
    model's process.

    ``search``: for :func:`held_out_errors`, the decomposition in float32 (the matrix
    scaled to a largest entry of 1 first, so its range fits float32's)."""
    sym = 0.5 * (sym + sym.T)
    if not search:
        return torch.linalg.eigh(sym)[1][:, -k:]
    scaled = (sym / sym.abs().max().clamp(min=1e-300)).float()
    return torch.linalg.eigh(scaled)[1][:, -k:].to(sym.dtype)


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
