"""Statistics of the study: means with Student-t 95% intervals, paired differences and
their verdicts in plain words.

Seeds are the unit of replication: a run's seed fixes its calibration sample, router
initialisation and training order, so two methods with the same seed saw the same data
and their difference is *paired* (the seed-to-seed variation they share cancels).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from scipy import stats as _scipy_stats

__all__ = [
    "MeanCI",
    "PairedDiff",
    "mean_ci",
    "paired_difference",
    "resolvable_task_mean_difference",
    "task_n_to_resolve",
    "t_quantile",
    "verdict",
]


def t_quantile(df: int, level: float = 0.95) -> float:
    """Two-sided Student-t critical value: ``t_{(1+level)/2, df}``."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return float(_scipy_stats.t.ppf(0.5 + level / 2.0, df))


@dataclass(frozen=True)
class MeanCI:
    """Mean of ``n`` values and the half-width of its confidence interval (``None``
    for a single value: no spread, no interval)."""

    mean: float
    ci95: float | None
    n: int
    sd: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def mean_ci(values: Sequence[float], level: float = 0.95) -> MeanCI:
    """``mean +- t_{df=n-1} * sd / sqrt(n)`` (sample standard deviation, ``n-1``)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return MeanCI(math.nan, None, 0, None)
    mean = sum(xs) / n
    if n == 1:
        return MeanCI(mean, None, 1, None)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return MeanCI(mean, t_quantile(n - 1, level) * sd / math.sqrt(n), n, sd)


@dataclass(frozen=True)
class PairedDiff:
    """``a - b`` over the seeds both have: mean, 95% half-width, seeds, p-value."""

    mean_diff: float
    ci95: float | None
    n_seeds: int
    p_value: float | None
    seeds: tuple[int, ...]
    diffs: tuple[float, ...]

    @property
    def significant(self) -> bool | None:
        """Whether the 95% interval excludes 0 (None with fewer than 2 seeds)."""
        if self.ci95 is None:
            return None
        return abs(self.mean_diff) > self.ci95

    def as_dict(self) -> dict:
        d = asdict(self)
        d["significant"] = self.significant
        return d


def paired_difference(
    a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95
) -> PairedDiff | None:
    """Paired difference ``a[seed] - b[seed]`` over the seeds where both are finite;
    None if there is none. The p-value is the two-sided paired t-test's."""
    seeds = tuple(
        s
        for s in sorted(set(a) & set(b))
        if a[s] is not None
        and b[s] is not None
        and math.isfinite(a[s])
        and math.isfinite(b[s])
    )
    if not seeds:
        return None
    diffs = tuple(float(a[s]) - float(b[s]) for s in seeds)
    m = mean_ci(diffs, level)
    p = None
    if m.n >= 2:
        if m.sd == 0:
            p = 0.0 if m.mean != 0 else 1.0
        else:
            t = m.mean / (m.sd / math.sqrt(m.n))
            p = float(2.0 * _scipy_stats.t.sf(abs(t), m.n - 1))
    return PairedDiff(m.mean, m.ci95, m.n, p, seeds, diffs)


def _fmt(x: float, unit: str) -> str:
    return f"{x:+.3f}" if unit == "acc" else f"{x:+.2f}"


def verdict(
    a_label: str,
    b_label: str,
    budget: float,
    metric: str,
    diff: PairedDiff | None,
    lower_is_better: bool,
) -> str:
    """One sentence, e.g. ``"AdaDSF vs uniform at 0.8: test PPL -1.30 ± 2.10 (3
    seeds), not significant"``. States which side is better only when the 95% interval
    excludes 0, whichever way it falls."""
    name = {"ppl_test": "test PPL", "task_mean": "7-task mean accuracy"}.get(
        metric, metric
    )
    head = f"{a_label} vs {b_label} at {budget:g}: {name}"
    if diff is None:
        return f"{head}: no paired runs yet"
    unit = "acc" if metric == "task_mean" else "ppl"
    if diff.ci95 is None:
        return (
            f"{head} {_fmt(diff.mean_diff, unit)} (1 seed): no confidence interval, "
            "no verdict"
        )
    half = _fmt(diff.ci95, unit).lstrip("+")
    body = f"{head} {_fmt(diff.mean_diff, unit)} ± {half} ({diff.n_seeds} seeds)"
    if not diff.significant:
        return f"{body}, not significant"
    a_better = (diff.mean_diff < 0) == lower_is_better
    winner = a_label if a_better else b_label
    return f"{body}, significant: {winner} is better"


def resolvable_task_mean_difference(
    task_n: Mapping[str, int],
    accuracy: Mapping[str, float] | None = None,
    level: float = 0.95,
) -> float | None:
    """Smallest difference in the mean accuracy over tasks that one comparison of two
    models can resolve at ``level``: ``z * sqrt(2) * sqrt(sum_i p_i (1 - p_i) / n_i) /
    T`` (two independent binomial estimates per task; ``p_i = 0.5``, the worst case,
    when ``accuracy`` is not given). Paired scoring of the same examples and several
    seeds both make the real resolution finer; this is the conservative figure."""
    if not task_n:
        return None
    z = float(_scipy_stats.norm.ppf(0.5 + level / 2.0))
    var = 0.0
    for task, n in task_n.items():
        p = 0.5 if accuracy is None else float(accuracy.get(task, 0.5))
        var += p * (1.0 - p) / max(n, 1)
    return z * math.sqrt(2.0) * math.sqrt(var) / len(task_n)


def task_n_to_resolve(
    task_n: Mapping[str, int],
    difference: float,
    available: Mapping[str, int] | None = None,
    level: float = 0.95,
) -> dict[str, int] | None:
    """The fewest examples per task for which :func:`resolvable_task_mean_difference`
    (worst case, ``p = 0.5``) is at most ``difference``: the same ``n`` for every task
    (fewest in total for a given variance of the mean), except that a task cannot
    score more than ``available[task]`` examples (its file), which the others then make
    up. ``None`` without tasks, for ``difference <= 0``, or when even every available
    example falls short."""
    if not task_n or difference <= 0:
        return None
    z = float(_scipy_stats.norm.ppf(0.5 + level / 2.0))
    # sum_i 0.25 / n_i may be at most this for the mean over T tasks to resolve it
    allowed = (difference * len(task_n) / (z * math.sqrt(2.0))) ** 2
    caps = dict(available or {})
    full: dict[str, int] = {}  # tasks that score their whole file
    while True:
        free = [t for t in task_n if t not in full]
        rest = allowed - sum(0.25 / n for n in full.values())
        if not free or rest <= 0:
            return None
        n_free = math.ceil(0.25 * len(free) / rest - 1e-9)
        short = {t: caps[t] for t in free if t in caps and caps[t] < n_free}
        if not short:
            return {t: full.get(t, n_free) for t in task_n}
        full.update(short)
